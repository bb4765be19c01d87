"""The composition root: build the pieces, host the Flask app in Twisted's WSGI container, run.

Order at boot: settings are valid (else exit 2); the models resolve and their memory policies can be
budgeted (else exit 2); NVML is opened for the GPU inventory; the port is bound; then the model
registry starts a worker per preloaded model (each applies its model's memory policy before
TensorFlow creates any tensor, loads and warms the model) while /readyz answers 503. A preloaded model
that fails its first load stops the server with exit 2, as a bad model always did. The HTTP process
itself never imports TensorFlow.

The gRPC services (app/grpc), unless grpc_port is off, listen beside the HTTP port in the same process,
over the same app and models; the notify channel's "listening" event carries both ports.

SIGTERM or SIGINT: /readyz turns 503, new inference requests get 503, those in flight finish (up to
shutdown_grace_s), the port is sealed and what the kernel queued answered (app/hosting/listening.py),
the port closes; the gRPC port stops taking calls at once and lets those in flight
finish within the same grace; every worker is stopped, exit 0.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError, DetectError, MissingExtra, ModelError, PolicyError
from ..extras import require_extra
from ..settings import (DEFAULT_CONFIG, FALSE_WORDS, TRUE_WORDS, Settings, check_model_names, default_text, env_name,
                        flag_name, grouped_setting_fields, load_settings, setting_fields, value_text)

log = logging.getLogger("app.serve")

CONTROL_THREADS = 2  # /metrics and /gpu: a pool of their own, so they answer under load
PROBE_THREADS = 2  # /healthz, /readyz, /v2/health/*: a pool that nothing else uses, so they answer whatever is held


def build_parser(config: Optional[Path] = None) -> argparse.ArgumentParser:
    """Return the `serve` flag parser: --config plus one flag per setting, in the reference's sections.

    The defaults shown are those `config` (None: config/default.toml if present) leads to, as `main` would.
    """
    effective, source, problem = _effective_defaults(config)
    note = (f"Defaults shown: the code's, then {source}'s." if problem is None
            else f"Defaults shown: the code's ({problem}).")
    parser = argparse.ArgumentParser(
        prog="python -m app serve", description=f"Serve detectors over HTTP. {note} DETECT_<NAME> variables "
        "override them, and flags override both.".replace("%", "%%"))
    parser.add_argument("--config", type=Path, default=None,
                        help="TOML settings file (default: config/default.toml if present)")
    for title, fields in grouped_setting_fields():
        group = parser.add_argument_group(title)
        for f in fields:
            shown = setting_help(f.name, effective, source)
            if isinstance(f.default, bool):
                group.add_argument(flag_name(f.name), dest=f.name, default=None,
                                   action=argparse.BooleanOptionalAction, help=shown)
            else:
                group.add_argument(flag_name(f.name), dest=f.name, default=None,
                                   metavar=f.name.split("_")[-1].upper(), help=shown)
    return parser


def _effective_defaults(config: Optional[Path]) -> tuple[Settings, Optional[str], Optional[str]]:
    """Return the settings the code and the config file give (no environment, no flags), the file, and any problem."""
    path = config if config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    try:
        return load_settings(config_path=path, environ={}), (str(path) if path is not None else None), None
    except ConfigError as exc:
        return Settings(), None, exc.message


def setting_help(name: str, effective: Optional[Settings] = None, source: Optional[str] = None) -> str:
    """Return a setting's --help line: its meaning, its effective default and its variable, escaped for argparse.

    A default the config file `source` changes says so; a secret one's value is never shown.
    """
    field = next(f for f in setting_fields() if f.name == name)
    value = getattr(effective, name) if effective is not None else field.default
    if value == field.default:
        default = default_text(name)
    elif field.metadata["secret"]:
        default = f"set in {source}"
    else:
        default = f"{value_text(name, value)}, from {source}"
    text = f"{field.metadata['help']} (default: {default}) [{env_name(name)}]"
    return text.replace("%", "%%")  # argparse %-formats help; '25%' would end it with ValueError


def _boolean_values(argv: list[str]) -> list[str]:
    """Rewrite `--preload false` and `--preload=false`, the older spelling, as `--no-preload` (true: `--preload`)."""
    flags = {flag_name(f.name) for f in setting_fields() if isinstance(f.default, bool)}
    words = TRUE_WORDS + FALSE_WORDS
    out: list[str] = []
    index = 0
    while index < len(argv):
        flag, equals, value = argv[index].partition("=")
        if flag in flags and not equals and index + 1 < len(argv) and argv[index + 1].lower() in words:
            equals, value = "=", argv[index + 1]
            index += 1
        if flag in flags and equals and value.lower() in words:
            out.append(flag if value.lower() in TRUE_WORDS else "--no-" + flag[2:])
        else:
            out.append(argv[index])
        index += 1
    return out


def main(argv: list[str]) -> int:
    """Parse flags, build settings, and serve until stopped; return the exit status."""
    config, args = parse_flags(argv)
    try:
        settings = load_settings(flags=args, config_path=config)
        if settings.tls_cert_file:  # Twisted's TLS needs pyOpenSSL
            require_extra("tls", "OpenSSL", "HTTPS (tls_cert_file)")
    except (ConfigError, MissingExtra) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    # It maps the lanes' shared memory: a crash prints every thread's stack to the log, not silence.
    faulthandler.enable()
    try:
        return serve(settings, config)
    except (ConfigError, ModelError, PolicyError) as exc:
        log.error("%s", exc.message)
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


def parse_flags(argv: list[str]) -> tuple[Optional[Path], dict[str, Any]]:
    """Return the --config file and the settings' raw flag values (None: not given); exit as argparse does."""
    argv = _boolean_values(argv)
    early = argparse.ArgumentParser(add_help=False)  # the file first, so that --help shows its defaults
    early.add_argument("--config", type=Path, default=None)
    args = vars(build_parser(early.parse_known_args(argv)[0].config).parse_args(argv))
    return args.pop("config"), args


def configure_logging(level: str) -> None:
    """Send Python and Twisted logs to stderr, one line each."""
    logging.basicConfig(
        level=level, stream=sys.stderr, force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from twisted.logger import STDLibLogObserver, globalLogBeginner

    globalLogBeginner.beginLoggingTo([STDLibLogObserver(name="twisted")], redirectStandardIO=False)


@dataclass
class Server:
    """The parts of a running server, built by `build` and run by `run`."""

    settings: Settings
    registry: Any  # app.models.registry.ModelRegistry
    gpu: Any  # app.gpu.report.GpuReport
    metrics: Any
    lifecycle: Any
    site: Any
    pools: list
    nvml: Any
    grpc: Any = None  # app.grpc.server.GrpcServer, or None with grpc_port off
    status: int = 0


def serve(settings: Settings, config: Optional[Path] = None) -> int:
    """Build the server and run it until it stops; return the exit status."""
    return run(build(settings, config))


def build(settings: Settings, config: Optional[Path] = None) -> Server:
    """Build every part but the listening port; raise ConfigError, ModelError or PolicyError."""
    from ..gpu.budget import inventory
    from ..gpu.report import GpuReport
    from ..gpu.setup import open_nvml
    from ..http.app import create_app
    from ..metrics import ServiceMetrics
    from ..models.registry import ModelRegistry
    from ..models.repository import ModelRepository
    from ..process import configure_allocator, configure_pillow
    from ..protocol.plane import DataPlane
    from .lifecycle import Lifecycle

    configure_pillow()
    log.info("memory allocator for decoding: %s", configure_allocator())
    repository = ModelRepository.open(settings.model_repository, settings.model)
    for problem in check_model_names(settings, _known_models(settings, repository), config):
        log.warning("%s; skipped (a file given with --config is checked strictly)", problem)
    names = repository.names()
    check_shared_policies(settings, names)
    nvml, nvml_reason = open_nvml()
    devices = _devices(nvml)
    gpus = inventory(devices, settings.gpu_total_mib, settings.gpus,
                     [i for name in repository.names() for i in settings.for_model(name).gpus or ()])
    registry_box: dict = {}
    gpu = GpuReport(nvml, nvml_reason, selected=settings.gpus, overhead_mib=settings.gpu_overhead_mib,
                    workers=lambda: registry_box["registry"].workers(), fleet_state=settings.fleet_state,
                    instance_name=settings.instance_name, groups=lambda: registry_box["registry"].groups())
    metrics = ServiceMetrics(gpu)
    registry = ModelRegistry(settings, repository, gpus, metrics=metrics, nvml=nvml)
    registry_box["registry"] = registry
    lifecycle = Lifecycle(settings.notify_fd)
    plane = DataPlane(settings, registry, gpu, metrics, lifecycle)
    app = create_app(plane)
    site, pools = _site(settings, app, registry, metrics, lifecycle)
    grpc_server = None
    if settings.grpc_port is not None:
        from ..grpc.server import GrpcServer

        grpc_server = GrpcServer(plane)
    return Server(settings, registry, gpu, metrics, lifecycle, site, pools, nvml, grpc_server)


def _known_models(settings: Settings, repository) -> list[str]:
    """The names a [models.<name>] table may use: the models served, and those of the repository folder."""
    from ..models.repository import ModelRepository

    names = set(repository.names())
    if settings.model and Path(settings.model_repository).is_dir():
        try:
            names.update(ModelRepository.open(settings.model_repository).names())
        except ModelError:
            pass
    return sorted(names)


def check_shared_policies(settings: Settings, names: list[str]) -> None:
    """Refuse greedy and growth for a model that may share a GPU with another: they cannot be budgeted."""
    for name in names:
        own = settings.for_model(name)
        if own.gpu_memory.mode not in ("greedy", "growth") or own.gpus == ():
            continue
        for other in names:
            theirs = settings.for_model(other).gpus
            same_group = own.worker_group and own.worker_group == settings.for_model(other).worker_group
            if other == name or theirs == () or same_group:  # its group's models share its one worker and policy
                continue
            if own.gpus is None or theirs is None or set(own.gpus) & set(theirs):
                what = ("maps nearly all of the GPU at start" if own.gpu_memory.mode == "greedy"
                        else "grows without bound and never gives memory back")
                raise ConfigError(
                    f"model {name} has gpu_memory {own.gpu_memory}, which {what}, but may share a GPU with model "
                    f"{other}: it cannot be budgeted; give it a cap (e.g. 4GiB) or a share (25%) in [models.{name}]")


def _devices(nvml) -> list:
    if nvml is None:
        return []
    try:
        return nvml.snapshot()
    except DetectError as exc:
        log.warning("NVML cannot list the GPUs: %s", exc.message)
        return []


def _site(settings: Settings, app, registry, metrics, lifecycle):
    """Host the app in two WSGI thread pools behind the service's Site; return the site and the pools."""
    from twisted.internet import reactor
    from twisted.python.threadpool import ThreadPool

    from ..protocol.admission import INFERENCE, VIDEO, Admission
    from .site import DetectSite, ProbeFirstRoot
    from .wsgi import TimedWSGIResource, whole_body_input

    wsgi_app = whole_body_input(app)
    resources, pools = [], []
    for name, size in (("wsgi", settings.http_threads), ("wsgi-control", CONTROL_THREADS),
                       ("wsgi-probe", PROBE_THREADS)):
        pool = ThreadPool(minthreads=1, maxthreads=size, name=name)
        reactor.callWhenRunning(pool.start)
        pools.append(pool)
        resources.append(TimedWSGIResource(reactor, pool, wsgi_app))

    def find_model(target: str):
        try:
            return registry.get(target) if target else registry.default()
        except DetectError:
            return None  # the app answers 404

    def refused(route: str, status: int, target: str):
        try:
            name = target or registry.default().name
        except DetectError:
            name = ""
        metrics.observe_refusal(route, status, name)

    admission = Admission("http", settings, lifecycle,
                          on_idle_end=lambda kind: metrics.observe_idle_end("http", kind))
    metrics.watch_open_calls(admission, [INFERENCE, VIDEO])
    site = DetectSite(ProbeFirstRoot(*resources), settings, lifecycle, admission, on_refused=refused,
                      find_model=find_model, on_stages=metrics.observe_stages)
    metrics.watch_in_flight(lambda: site.in_flight)
    return site, pools


def _tls_options(settings: Settings):
    """Twisted's TLS options from the certificate and key files, or None for plain HTTP."""
    if not settings.tls_cert_file:
        return None
    from twisted.internet import ssl

    require_extra("tls", "OpenSSL", "HTTPS (tls_cert_file)")  # main says so at once; this, for a direct caller
    pem = Path(settings.tls_key_file).read_bytes() + b"\n" + Path(settings.tls_cert_file).read_bytes()
    try:
        return ssl.PrivateCertificate.loadPEM(pem).options()
    except Exception as exc:  # OpenSSL's own errors: a key that is not the certificate's, a file not PEM
        raise ValueError(f"{settings.tls_cert_file} and {settings.tls_key_file} are not a PEM certificate and "
                         f"its private key ({type(exc).__name__})") from None


def _grpc_tls(settings: Settings) -> Optional[tuple[bytes, bytes]]:
    """The gRPC port's (key, certificate) PEM pair: the same files as HTTPS; None for plain gRPC."""
    if not settings.tls_cert_file:
        return None
    return Path(settings.tls_key_file).read_bytes(), Path(settings.tls_cert_file).read_bytes()


def _log_access(settings: Settings) -> None:
    """Say at boot who may use the control routes, naming the restricted groups and headers, never values."""
    from ..access import MODEL_REPOSITORY, parse_restricted_api

    restrictions = parse_restricted_api(settings.restricted_api)
    for restriction in restrictions:
        log.info("restricted API: %s need header %s", ", ".join(sorted(restriction.groups)), restriction.header)
    if not any(MODEL_REPOSITORY in r.groups for r in restrictions):
        log.info("the model-repository routes (load, unload, index) answer loopback clients only; "
                 "restricted_api can grant them to a header (SECURITY.md)")


def run(server: Server) -> int:
    """Bind, start the models, and run the reactor until shutdown; return the exit status."""
    from twisted.internet import defer, reactor, task, threads
    from twisted.internet.error import CannotListenError

    from .lifecycle import HEARTBEAT_S

    settings = server.settings
    try:
        tls = _tls_options(settings)
    except (OSError, ValueError, MissingExtra) as exc:
        log.error("cannot serve HTTPS: %s", exc)
        print(f"error: cannot serve HTTPS: {exc}", file=sys.stderr)
        return 2
    try:
        if tls is None:
            port = reactor.listenTCP(settings.port, server.site, backlog=settings.listen_backlog,
                                     interface=settings.host)
        else:
            port = reactor.listenSSL(settings.port, server.site, tls, backlog=settings.listen_backlog,
                                     interface=settings.host)
    except CannotListenError as exc:
        return _cannot_listen("HTTP", settings.host, settings.port, exc.socketError, "port")
    address = port.getHost()
    grpc_port = None
    if server.grpc is not None:
        try:
            grpc_port = server.grpc.bind(settings.host, settings.grpc_port, _grpc_tls(settings))
        except (OSError, RuntimeError) as exc:
            return _cannot_listen("gRPC", settings.host, settings.grpc_port, exc, "grpc_port")
        server.grpc.start()
    server.lifecycle.listening(address.host, address.port, grpc_port)
    log.info("listening on %s://%s:%d (models %s; default %s)", "http" if tls is None else "https", address.host,
             address.port, ", ".join(server.registry.names()),
             server.registry.default_name() or "none (set default_model)")
    if grpc_port is not None:
        log.info("gRPC (KServe v2, TF Serving, health, reflection) on %s:%d%s", settings.host, grpc_port,
                 " with TLS" if tls is not None else "")
    _log_access(settings)
    if not settings.decode_at_model_size:
        log.info("decoding images at full size (decode_at_model_size is off)")

    def watch_readiness():
        failure = server.registry.boot_failure()
        if failure is not None:
            log.error("cannot load a preloaded model: %s", failure)
            print(f"error: {failure}", file=sys.stderr)
            server.status = 2
            readiness.stop()
            reactor.stop()
        elif server.registry.ready:
            readiness.stop()
            if server.lifecycle.serving():
                log.info("ready: %s", ", ".join(f"{m['name']} version {m['version']}"
                                                for m in server.registry.describe() if m["state"] == "ready"))

    readiness = task.LoopingCall(watch_readiness)

    def shut_down():
        if server.lifecycle.begin_draining():
            log.info("shutting down: not ready, refusing new work, %d request(s) in flight (%d inference)",
                     server.site.in_flight, server.site.inference_in_flight)
        drains = [server.site.drain(port, settings.shutdown_grace_s)]
        if server.grpc is not None:
            drains.append(threads.deferToThread(server.grpc.drain, settings.shutdown_grace_s))
        drained = defer.gatherResults(drains)
        drained.addCallback(lambda _: threads.deferToThread(server.registry.close, settings.shutdown_grace_s))
        return drained

    heartbeat = task.LoopingCall(server.lifecycle.beat)
    reactor.callWhenRunning(server.registry.start)
    reactor.callWhenRunning(readiness.start, 0.1)
    reactor.callWhenRunning(heartbeat.start, HEARTBEAT_S)
    reactor.addSystemEventTrigger("before", "shutdown", shut_down)
    reactor.run()
    server.lifecycle.stopped()
    return _finish(server)


def _cannot_listen(protocol: str, host: str, port: int, reason: object, setting: str) -> int:
    """Log and print why a port cannot be bound, naming the setting, flag and variable that change it; return 1."""
    message = (f"cannot listen for {protocol} on {host}:{port}: {reason}; is another server on it? change the port "
               f"with {flag_name(setting)} / {env_name(setting)} / {setting} in the config file")
    log.error("%s", message)
    print(f"error: {message}", file=sys.stderr)
    return 1


def _finish(server: Server) -> int:
    # Stop the WSGI pools off the reactor thread: a request still running past the grace waits on
    # the stopped reactor for ever, and joining its thread would hang the exit.
    stopper = threading.Thread(target=lambda: [pool.stop() for pool in server.pools], daemon=True)
    stopper.start()
    stopper.join(5.0)
    if server.grpc is not None:
        server.grpc.stop()
    server.registry.close(5.0)  # a no-op after a drain; workers never outlive the server
    if server.nvml is not None:
        server.nvml.close()
    log.info("stopped")
    if stopper.is_alive() or (server.grpc is not None and server.grpc.admission.open_calls("inference") > 0):
        log.warning("abandoning request(s) still running after the shutdown grace")
        logging.shutdown()
        os._exit(server.status)  # their threads would keep the process alive
    return server.status
