"""The composition root: build the pieces, host the Flask app in Twisted's WSGI container, run.

Order at boot: settings are valid (else exit 2), the model path resolves (else exit 2), the GPU
memory policy is applied before TensorFlow creates any tensor (else exit 2), the port is bound,
then the model loads and warms up in a thread while /readyz answers 503. SIGTERM or SIGINT: /readyz
turns 503, new /detect requests get 503, those in flight finish (up to shutdown_grace_s), the port
closes, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path

from .errors import ConfigError, DetectError, ModelError, PolicyError
from .settings import Settings, env_name, flag_name, load_settings, setting_fields

log = logging.getLogger("app.serve")


def build_parser() -> argparse.ArgumentParser:
    """Return the `serve` flag parser: --config plus one flag per setting."""
    parser = argparse.ArgumentParser(prog="python -m app serve", description="Serve a detector over HTTP.")
    parser.add_argument("--config", type=Path, default=None,
                        help="TOML settings file (default: config/default.toml if present)")
    for f in setting_fields():
        parser.add_argument(flag_name(f.name), dest=f.name, default=None, metavar=f.name.split("_")[-1].upper(),
                            help=f"{f.metadata['help']} [{env_name(f.name)}]")
    return parser


def main(argv: list[str]) -> int:
    """Parse flags, build settings, and serve until stopped; return the exit status."""
    args = vars(build_parser().parse_args(argv))
    config = args.pop("config")
    try:
        settings = load_settings(flags=args, config_path=config)
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    try:
        return serve(settings)
    except (ConfigError, ModelError, PolicyError) as exc:
        log.error("%s", exc.message)
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


def configure_logging(level: str) -> None:
    """Send Python and Twisted logs to stderr, one line each."""
    logging.basicConfig(
        level=level, stream=sys.stderr, force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from twisted.logger import STDLibLogObserver, globalLogBeginner

    globalLogBeginner.beginLoggingTo([STDLibLogObserver(name="twisted")], redirectStandardIO=False)


def serve(settings: Settings) -> int:
    """Apply the policy, bind, load the model in a thread, and run the reactor until shutdown."""
    from .model_store import resolve_model

    resolve_model(settings.model)  # a missing or empty folder is a boot error, before binding

    from .gpu_setup import setup_gpus

    gpu_setup = setup_gpus(settings)  # before TensorFlow creates any tensor

    from twisted.internet import reactor, threads
    from twisted.internet.error import CannotListenError
    from twisted.python.threadpool import ThreadPool
    from twisted.web.wsgi import WSGIResource

    from .detector import load_detector
    from .gpu_report import GpuReport
    from .http_app import create_app
    from .inference import batching_detector
    from .metrics import ServiceMetrics
    from .site import DetectSite, ProbeFirstRoot, whole_body_input
    from .state import ServingState

    gpu = GpuReport(gpu_setup, fleet_state=settings.fleet_state, instance_name=settings.instance_name)
    metrics = ServiceMetrics(gpu)
    state = ServingState()
    app = create_app(settings, state, gpu, metrics)

    wsgi_app = whole_body_input(app)
    resources, pools = [], []
    for name, size in (("wsgi", settings.http_threads), ("wsgi-control", 2)):
        pool = ThreadPool(minthreads=1, maxthreads=size, name=name)
        reactor.callWhenRunning(pool.start)
        pools.append(pool)
        resources.append(WSGIResource(reactor, pool, wsgi_app))

    def queue_refusal():
        serving = state.detector
        return serving.queue.refusal() if serving is not None else None

    site = DetectSite(ProbeFirstRoot(*resources), settings, on_refused=metrics.observe_refusal,
                      queue_refusal=queue_refusal)
    metrics.watch_in_flight(lambda: site.in_flight)
    try:
        port = reactor.listenTCP(settings.port, site, interface=settings.host)
    except CannotListenError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.socketError)
        print(f"error: cannot listen on {settings.host}:{settings.port}: {exc.socketError}", file=sys.stderr)
        return 1
    address = port.getHost()
    log.info("listening on http://%s:%d (model %s, %s)", address.host, address.port, settings.model,
             gpu_setup.policy.describe())

    outcome = {"status": 0}

    def load():
        started = time.perf_counter()
        detector = load_detector(
            settings.model, on_model_call=metrics.observe_model_call,
            on_out_of_memory=metrics.out_of_memory.inc, memory_limit=gpu_setup.policy.memory_limit(),
        )
        detector.warm_up()
        serving = batching_detector(
            detector, settings.max_batch_size, settings.max_batch_delay_ms, settings.inference_threads,
            settings.max_queue, settings.request_deadline_s, on_wait=metrics.queue_wait.observe,
        )
        metrics.watch_queue(serving.queue)
        reactor.addSystemEventTrigger("during", "shutdown", serving.queue.close)
        return serving, time.perf_counter() - started

    def loaded(result):
        detector, seconds = result
        state.set_detector(detector)
        log.info("ready: model %s version %s loaded and warmed in %.1f s (batches of up to %d, %d inference "
                 "thread(s))", detector.name, detector.version, seconds, detector.queue.max_batch,
                 settings.inference_threads)

    def failed(failure):
        error = failure.value
        message = error.message if isinstance(error, DetectError) else f"{type(error).__name__}: {error}"
        log.error("cannot load the model: %s", message)
        print(f"error: {message}", file=sys.stderr)
        outcome["status"] = 2
        if reactor.running:
            reactor.stop()

    def start_loading():
        threads.deferToThread(load).addCallbacks(loaded, failed)

    def drain():
        state.start_draining()
        log.info("shutting down: not ready, refusing new work, %d request(s) in flight (%d /detect)",
                 site.in_flight, site.detect_in_flight)
        return site.drain(port, settings.shutdown_grace_s)

    reactor.callWhenRunning(start_loading)
    reactor.addSystemEventTrigger("before", "shutdown", drain)
    reactor.run()
    # Stop the WSGI pools off the reactor thread: a request still running past the grace waits on
    # the stopped reactor for ever, and joining its thread would hang the exit.
    stopper = threading.Thread(target=lambda: [pool.stop() for pool in pools], daemon=True)
    stopper.start()
    stopper.join(5.0)
    if gpu_setup.nvml is not None:
        gpu_setup.nvml.close()
    log.info("stopped")
    if stopper.is_alive():
        log.warning("abandoning request(s) still running after the shutdown grace")
        logging.shutdown()
        os._exit(outcome["status"])  # their threads would keep the process alive
    return outcome["status"]
