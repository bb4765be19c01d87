"""The one settings object: defaults in code <- TOML file <- DETECT_* environment <- flags.

`load_settings` is the only reader of the environment in the project. Every value is parsed with a
strict cast; a bad one raises ConfigError naming the setting (env name and flag), the value and
what is allowed, and the entry point turns that into exit status 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from .errors import ConfigError
from .gpu.memory_policy import MemorySpec, parse_gpu_list, parse_memory_spec
from .settings_groups import GROUP_KEYS, check_group_conflicts, group_name, group_values, parse_tables

ENV_PREFIX = "DETECT_"
DEFAULT_CONFIG = Path("config/default.toml")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _int_in(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError(f"expected an integer from {lo} to {hi}")
        try:
            number = int(str(value).strip())
        except ValueError:
            raise ValueError(f"expected an integer from {lo} to {hi}") from None
        if not lo <= number <= hi:
            raise ValueError(f"expected an integer from {lo} to {hi}")
        return number

    return parse


def _float_in(lo: float, hi: float) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        try:
            number = float(str(value).strip())
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and lo <= number <= hi):
            raise ValueError(f"expected a number from {lo:g} to {hi:g}")
        return number

    return parse


_BYTES = re.compile(r"^\s*(\d+)\s*(b|kib|mib|gib)?\s*$", re.IGNORECASE)
_UNIT = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _bytes_in(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        match = _BYTES.match(str(value))
        allowed = f"expected a size from {lo} to {hi} bytes, such as '20MiB' or '1048576'"
        if not match:
            raise ValueError(allowed)
        number = int(match.group(1)) * _UNIT[(match.group(2) or "b").lower()]
        if not lo <= number <= hi:
            raise ValueError(allowed)
        return number

    return parse


def _text(value: Any) -> str:
    text = str(value).strip()
    if not text:
        raise ValueError("expected a non-empty string")
    return text


def _optional_text(value: Any) -> str:
    return str(value).strip()


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ValueError("expected true or false (also 1/0, yes/no, on/off)")


MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def _model_name(value: Any) -> str:
    name = str(value).strip()
    if name and not MODEL_NAME.match(name):
        raise ValueError("expected a model name: letters, digits, '.', '_' or '-', at most 63")
    return name


_ORIGIN = re.compile(r"^(https?)://([a-z0-9]([a-z0-9.-]*[a-z0-9])?|\[[0-9a-f:.]+\])(:(\d{1,5}))?$")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _origins(value: Any) -> tuple[str, ...]:
    """Parse browser origins (scheme://host[:port]), comma-separated or a TOML list, as browsers write them."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    origins = []
    for item in items:
        origin = str(item).strip().rstrip("/").lower()
        if not origin:
            continue
        match = _ORIGIN.match(origin)
        if not match or (match.group(5) and not 0 < int(match.group(5)) < 65536):
            raise ValueError("expected origins such as https://app.example or http://localhost:3000, comma-separated: "
                             "a scheme, a host and a port, no path, and no '*'")
        if match.group(5) == _DEFAULT_PORTS[match.group(1)]:  # a browser's Origin header leaves it out
            origin = origin[: -len(match.group(4))]
        origins.append(origin)
    return tuple(dict.fromkeys(origins))


def _precision(value: Any) -> str:
    from .inference.accelerators import PRECISIONS

    word = str(value).strip().lower()
    if word not in PRECISIONS:
        raise ValueError(f"expected one of {', '.join(PRECISIONS)}")
    return word


def _port_or_off(value: Any) -> Optional[int]:
    if str(value).strip().lower() == "off":
        return None
    try:
        return _int_in(0, 65535)(value)
    except ValueError:
        raise ValueError("expected a TCP port from 0 to 65535, or off") from None


def _log_level(value: Any) -> str:
    level = str(value).strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
    return level


def _setting(default: Any, parse: Callable[[Any], Any], help: str, secret: bool = False, unset: str = '""') -> Any:
    """A setting; a `secret` one's value never appears in an error message or a repr; `unset` writes None."""
    return field(default=default, metadata={"parse": parse, "help": help, "secret": secret, "unset": unset},
                 repr=not secret)


def _restricted_api(value: Any) -> str:
    from .access import parse_restricted_api

    parse_restricted_api(value)  # refuse it at boot; the app parses it again into restrictions
    return str(value).strip()


@dataclass(frozen=True)
class Settings:
    """Every setting of the service; built once at boot, then read-only."""

    host: str = _setting("127.0.0.1", _text, "interface to listen on")
    port: int = _setting(8000, _int_in(0, 65535), "TCP port to listen on (0: any free port, logged at boot)")
    # Off: the service's case is several instances side by side with only the HTTP port changed, and a fixed
    # second port would make the second one fail to bind (docs/concepts/ports.md). The image, compose.yaml and
    # the Helm chart name 8001, Triton's, which its gRPC clients and perf_analyzer default to.
    grpc_port: Optional[int] = _setting(
        None, _port_or_off,
        "TCP port of the gRPC services, KServe v2 and TF Serving (off: none, so that instances on other HTTP "
        "ports never collide; 8001: Triton's; 0: any free port)", unset="off",
    )
    model: str = _setting(
        "", _optional_text,
        "serve only this model: a base path (its highest version) or one version folder ('': the repository)"
    )
    model_repository: str = _setting(
        "models", _text, "folder of models, TF Serving's layout: <repository>/<name>/<version>/saved_model.pb"
    )
    default_model: str = _setting("", _model_name, "the model POST /detect serves ('': the only model)")
    gpu_memory: MemorySpec = _setting(
        parse_memory_spec("4GiB"), parse_memory_spec,
        "GPU memory policy of each model's worker: greedy, growth, a cap (4096, 4096MiB, 4GiB) or a share (25%)",
    )
    gpus: Optional[tuple[int, ...]] = _setting(
        None, parse_gpu_list, "physical GPUs the workers may use ('' all, 'none', or '0,1')"
    )
    max_images_per_request: int = _setting(16, _int_in(1, 256), "most images one /detect request may carry")
    default_threshold: float = _setting(0.5, _float_in(0.0, 1.0), "score threshold when the request gives none")
    max_body_bytes: int = _setting(
        20 * 2**20, _bytes_in(1024, 2**31), "largest request body, chunked bodies included (bytes, or 20MiB)"
    )
    max_image_pixels: int = _setting(
        40_000_000, _int_in(1, 2**31), "largest image, width x height, checked from the header before decoding"
    )
    # On: answers stay those of full-size decoding (docs/concepts/decoding.md), at a fraction of a 12 MP JPEG's decoding.
    decode_at_model_size: bool = _setting(
        True, _bool, "decode images no larger than the model's working size (JPEGs by the decoder's own "
        "1/2, 1/4, 1/8 scaling); off: full size"
    )
    http_threads: int = _setting(
        128, _int_in(1, 1024), "WSGI threads: inference requests admitted at once; beyond, 503 with Retry-After"
    )
    # One idle rule for everything a client can hold open: an HTTP connection, and a gRPC call that stays open
    # (an inference stream, a health Watch, a reflection stream) with no message either way.
    idle_timeout_s: float = _setting(
        60.0, _float_in(1.0, 3600.0), "close a connection, or end a call held open (a gRPC stream, a Watch), idle "
        "this long (s)"
    )
    # Half of http_threads, as before there was a setting: each open stream holds a gRPC thread, and its requests
    # run on a pool of http_threads of their own (app/grpc/calls.py).
    max_streams: int = _setting(
        64, _int_in(1, 1024), "gRPC inference streams (ModelStreamInfer) open at once; beyond, RESOURCE_EXHAUSTED"
    )
    # A Watch holds no thread while it waits (it is answered from one ticker), only a few hundred bytes.
    max_watches: int = _setting(
        256, _int_in(1, 65536), "gRPC health Watch calls open at once; beyond, RESOURCE_EXHAUSTED"
    )
    # Twisted's default of 50 overflowed under bursts of 160 connections while the reactor was busy (the
    # chaos soak, docs/how-to/chaos.md): the kernel dropped handshakes and reset some connections after 1 s.
    # 2048 as gunicorn and uvicorn; the kernel caps it at net.core.somaxconn.
    listen_backlog: int = _setting(
        2048, _int_in(1, 65535), "connections the kernel queues for the server to accept (capped by net.core.somaxconn)"
    )
    shutdown_grace_s: float = _setting(
        20.0, _float_in(0.0, 600.0), "on SIGTERM, wait this long for requests in flight (s)"
    )
    log_level: str = _setting("INFO", _log_level, "DEBUG, INFO, WARNING or ERROR")
    # Access (SECURITY.md): Triton's --http-restricted-api form; the model-repository routes are loopback-only
    # unless an entry grants them to a header.
    restricted_api: str = _setting(
        "", _restricted_api, "route groups that need a header: <group>[,<group>]:<header>=<value>[;...] ('' none)",
        secret=True,
    )
    # On: a client on this host could otherwise register an object of another user that the server's user can
    # open (a 0600 file of root's, for a server running as root), and read or write it through the server.
    shared_memory_same_owner: bool = _setting(
        True, _bool, "register only shared-memory objects owned by the server's own user (false: any it can open)"
    )
    tls_cert_file: str = _setting("", _optional_text, "PEM certificate (chain) to serve HTTPS with ('' plain HTTP)")
    tls_key_file: str = _setting("", _optional_text, "PEM private key of tls_cert_file")
    # Empty: the page is served from this origin and needs none; a browser app elsewhere must be listed.
    cors_origins: tuple[str, ...] = _setting(
        (), _origins, "origins whose browser pages may call the API (comma-separated, e.g. https://app.example; '' none)"
    )
    # Inference scheduling: batching, concurrency, admission.
    max_batch_size: int = _setting(
        16, _int_in(1, 256), "most images in one model call (batching needs a model whose batch dimension is None)"
    )
    # 0, as TF Serving's batch_timeout_micros and Triton's max_queue_delay_microseconds default to: a
    # call takes the images already waiting; under load they pile up while the previous call runs.
    max_batch_delay_ms: float = _setting(
        0.0, _float_in(0.0, 1000.0),
        "longest an image waits for others to share its model call (ms; 0: take the images already waiting)"
    )
    # Two: one call's host-side work (stacking, tensor conversion, answers) and the gaps in its
    # parallelism overlap the other's; on 2 CPU cores 16 x 2 beat 32 x 1 by 18% (docs/measured.md).
    inference_threads: int = _setting(2, _int_in(1, 64), "model calls that may run at once")
    max_queue: int = _setting(
        128, _int_in(1, 100000), "images that may wait for a model; beyond, its requests get 503 with Retry-After"
    )
    request_deadline_s: float = _setting(
        30.0, _float_in(0.1, 3600.0), "longest an inference request may wait for its answers (a load included) before 504 (s)"
    )
    header_timeout_s: float = _setting(
        10.0, _float_in(0.5, 600.0), "close a connection whose request line and headers take longer (s)"
    )
    body_timeout_s: float = _setting(
        30.0, _float_in(0.5, 3600.0), "close a connection whose body takes longer than this to arrive (s)"
    )
    # Video (POST /detect/video, the `video` extra): each video is refused whole, before it is decoded, when a limit
    # is passed. 100 MiB and 10 minutes hold a phone's 1080p clip of a few minutes; 18000 frames: 10 minutes at 30 fps.
    max_video_bytes: int = _setting(
        100 * 2**20, _bytes_in(1024, 2**36),
        "largest video body, streamed to a temporary file as it arrives (bytes, or 100MiB)"
    )
    max_video_s: float = _setting(600.0, _float_in(0.1, 86400.0), "longest video, first frame to last (s)")
    max_video_frames: int = _setting(
        18000, _int_in(1, 10_000_000), "most frames a video may hold, sampled or not (each is decoded)"
    )
    max_video_fps: float = _setting(
        30.0, _float_in(0.1, 240.0), "most frames per second of video sent to the model; the fps a request asks for is "
        "at most this (default: every frame up to this rate)"
    )
    # 32: two batches of 16, so a lone video keeps both inference threads' calls full while another client's image
    # waits behind at most two calls.
    video_frames_in_flight: int = _setting(
        32, _int_in(1, 1024), "frames of one video in the model's queue or its calls at once"
    )
    video_decoder_threads: int = _setting(2, _int_in(1, 16), "FFmpeg decoding threads per video")
    # 16: an eighth of http_threads' 128, so that videos, each holding a request thread for as long as it lasts,
    # leave the rest to images.
    max_video_streams: int = _setting(
        16, _int_in(1, 1024), "videos answered at once (each also counts in http_threads); beyond, 503 with Retry-After"
    )
    # Model workers: their budget, their lifecycle and their supervision.
    gpu_total_mib: int = _setting(
        0, _int_in(0, 2**24), "GPU memory per GPU the budget may fill (MiB; 0: each GPU's total from NVML)"
    )
    # 1024: on an H200 (CUDA 13, driver 580) a bare CUDA context is 520 MiB and 720 MiB once cuBLAS and cuDNN
    # are loaded (scripts/gpu-check, docs/how-to/gpu-check.md); TensorFlow's own kernels come on top.
    gpu_overhead_mib: int = _setting(
        1024, _int_in(0, 65536), "budgeted per worker beyond its cap: CUDA context, cuDNN/cuBLAS workspaces (MiB)"
    )
    # Five minutes: a model used at least that often never pays a load; one idle longer gives its cap
    # and CUDA context back for a cold start of about a second (docs/concepts/workers.md).
    idle_unload_s: float = _setting(
        300.0, _float_in(0.0, 30 * 86400.0), "unload a model idle this long, giving its memory back (s; 0: never)"
    )
    preload: bool = _setting(True, _bool, "load models at boot (false: at their first request)")
    # '': a worker per model, the isolation of a crash and a cap per model; a name shares one worker, its CUDA
    # context and one cap with the other models that name it ([groups.<name>], app/settings_groups.py).
    worker_group: str = _setting(
        "", group_name, "the worker group a model runs in: models naming the same group share one worker process "
        "and its [groups.<name>] cap ('': a worker of its own)"
    )
    # Execution accelerators (docs/concepts/precision.md). auto, because where it picks nothing it is fp32 at no
    # cost, and where it picks bf16 it was 1.3 to 1.55x fp32's speed for objects and shapes here at batch 4 and
    # 16, with the same answers (docs/measured.md#precision). Faces was slower in bf16, so auto also times its
    # pick at load.
    precision: str = _setting(
        "auto", _precision,
        "how a model computes: auto (bf16 on a CPU with native bf16, fp16 on a GPU with tensor cores, else fp32), "
        "fp32, bf16 or fp16; a reduced one only where the parity gate passes"
    )
    parity_gate: bool = _setting(
        True, _bool, "check a reduced precision against fp32 on the model's reference photos at load "
        "(false: run it unchecked, with a warning)"
    )
    # Five seconds: listing a few folders is free, and a new version then serves within seconds of landing.
    model_poll_s: float = _setting(
        5.0, _float_in(0.0, 86400.0), "look for new model versions this often (s; 0: never)"
    )
    spare_workers: int = _setting(
        1, _int_in(0, 8), "workers kept started with TensorFlow imported, so a load skips the import (0: none)"
    )
    load_timeout_s: float = _setting(
        300.0, _float_in(1.0, 3600.0), "longest a model may take to load and warm up before its worker is killed (s)"
    )
    max_failures: int = _setting(
        5, _int_in(1, 1000), "give a model's worker up after this many unexpected exits in failure_window_s"
    )
    failure_window_s: float = _setting(300.0, _float_in(1.0, 86400.0), "the window max_failures counts in (s)")
    restart_backoff_s: float = _setting(
        1.0, _float_in(0.0, 600.0), "first restart delay of a worker that exited; doubled per recent exit (s)"
    )
    # Set by `python -m app fleet` on each instance it starts; /gpu reads them to account per process.
    fleet_state: str = _setting(
        "", lambda value: str(value).strip(), "fleet state file (JSON) naming each instance's pid and caps ('' none)"
    )
    instance_name: str = _setting("", lambda value: str(value).strip(), "this instance's name in its fleet ('' none)")
    notify_fd: int = _setting(
        -1, _int_in(-1, 65535), "descriptor on which to report listening and ready as JSON lines (-1: none)"
    )
    # [models.<name>] tables of the TOML file: per-model overrides of PER_MODEL_KEYS, parsed.
    model_overrides: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = field(default=(), metadata={})
    # [groups.<name>] tables: each worker group's process-wide settings (GROUP_KEYS), parsed.
    group_tables: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = field(default=(), metadata={})

    def for_model(self, name: str) -> "ModelSettings":
        """Return the settings of one model: the server-wide values, then its [models.<name>] table."""
        values = {key: getattr(self, key) for key in PER_MODEL_KEYS}
        values.update(dict(self.overrides_for(name)))
        if values["worker_group"]:  # what its worker applies process-wide is its group's
            values.update(group_values(values["worker_group"], self.group_tables, vars(self)))
        return ModelSettings(**values)

    def overrides_for(self, name: str) -> tuple[tuple[str, Any], ...]:
        """Return the keys a model's table sets, parsed, in the file's order."""
        return dict(self.model_overrides).get(name, ())


# What a [models.<name>] table may set; everything else is server-wide.
PER_MODEL_KEYS = ("gpu_memory", "gpus", "max_batch_size", "max_batch_delay_ms", "inference_threads", "max_queue",
                  "idle_unload_s", "preload", "precision", "parity_gate", "worker_group")


# The TOML file's tables: section -> (the Settings field they fill, the keys a table may set, what it names).
TABLES = {"models": ("model_overrides", PER_MODEL_KEYS, "model"), "groups": ("group_tables", GROUP_KEYS, "worker group")}


@dataclass(frozen=True)
class ModelSettings:
    """The settings one model's worker and queue run with."""

    gpu_memory: MemorySpec
    gpus: Optional[tuple[int, ...]]
    max_batch_size: int
    max_batch_delay_ms: float
    inference_threads: int
    max_queue: int
    idle_unload_s: float
    preload: bool
    precision: str
    parity_gate: bool
    worker_group: str = ""


def env_name(name: str) -> str:
    """Return the environment variable for a setting, e.g. DETECT_GPU_MEMORY."""
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    """Return the command-line flag for a setting, e.g. --gpu-memory."""
    return "--" + name.replace("_", "-")


# The sections of `serve --help` and of the settings reference, in their order; each setting is in one.
SETTING_GROUPS = (
    ("Listening", ("host", "port", "grpc_port", "tls_cert_file", "tls_key_file", "listen_backlog")),
    ("Models", ("model", "model_repository", "default_model")),
    ("GPU memory", ("gpu_memory", "gpus", "gpu_total_mib", "gpu_overhead_mib")),
    ("Model workers", ("preload", "worker_group", "spare_workers", "idle_unload_s", "model_poll_s", "load_timeout_s", "max_failures",
                       "failure_window_s", "restart_backoff_s")),
    ("Execution: precision", ("precision", "parity_gate")),
    ("Requests and images", ("max_images_per_request", "default_threshold", "max_body_bytes", "max_image_pixels",
                             "decode_at_model_size")),
    ("Scheduling: batching, concurrency, admission", ("max_batch_size", "max_batch_delay_ms", "inference_threads",
                                                      "max_queue", "http_threads", "request_deadline_s")),
    ("Video", ("max_video_bytes", "max_video_s", "max_video_frames", "max_video_fps", "video_frames_in_flight",
               "video_decoder_threads", "max_video_streams")),
    ("Connections and shutdown", ("idle_timeout_s", "header_timeout_s", "body_timeout_s", "max_streams",
                                  "max_watches", "shutdown_grace_s")),
    ("Access", ("restricted_api", "shared_memory_same_owner", "cors_origins")),
    ("Logging and launchers", ("log_level", "fleet_state", "instance_name", "notify_fd")),
)


def grouped_setting_fields() -> list[tuple[str, list[dataclasses.Field]]]:
    """Return (section title, its settings) in SETTING_GROUPS' order."""
    by_name = {f.name: f for f in setting_fields()}
    return [(title, [by_name[name] for name in names]) for title, names in SETTING_GROUPS]


def default_text(name: str) -> str:
    """Return a setting's default as it would be written in the TOML file or a flag, e.g. 4096MiB, 20MiB, true."""
    return value_text(name, getattr(Settings(), name))


def value_text(name: str, value: Any) -> str:
    """Return a setting's value as it would be written in the TOML file or a flag."""
    if value is None:
        return next(f for f in setting_fields() if f.name == name).metadata["unset"]
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or '""'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"{value // 2**20}MiB"
    return str(value)


def setting_fields() -> list[dataclasses.Field]:
    """Return the settings a flag, a DETECT_* variable or a top-level TOML key can set."""
    return [f for f in dataclasses.fields(Settings) if "parse" in f.metadata]


def load_settings(
    flags: Optional[Mapping[str, Any]] = None,
    config_path: Optional[Path] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Settings:
    """Build Settings from defaults, the TOML file, DETECT_* variables and flags, in that order.

    `flags` maps setting names to raw flag values (None: not given). `config_path` None means
    config/default.toml if it exists. Raise ConfigError for any bad value or unknown key.
    """
    environ = os.environ if environ is None else environ
    by_name = {f.name: f for f in setting_fields()}
    values: dict[str, Any] = {}

    path = config_path if config_path is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    if path is not None:
        for key, raw in _read_toml(Path(path)).items():
            if key in TABLES:
                field_name, keys, what = TABLES[key]
                values[field_name] = parse_tables(
                    key, raw, path, keys, lambda name, value, source: _parse(by_name[name], value, source), what)
                continue
            if key not in by_name:
                raise ConfigError(
                    f"config file {path} has unknown setting {key!r}; known settings: {', '.join(by_name)}"
                )
            values[key] = _parse(by_name[key], raw, f"{key} in {path}")

    given: set[str] = set()  # set by the environment or a flag
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in by_name:
            raise ConfigError(
                f"environment variable {key} is not a setting; known: "
                + ", ".join(env_name(n) for n in by_name)
            )
        values[name] = _parse(by_name[name], raw, key)
        given.add(name)

    for name, raw in (flags or {}).items():
        if raw is None:
            continue
        if name not in by_name:
            raise ConfigError(f"unknown setting {name!r}")
        values[name] = _parse(by_name[name], raw, flag_name(name))
        given.add(name)

    # A DETECT_* variable or a flag is this deployment's word for every model: it beats the file's tables.
    values["model_overrides"] = tuple(
        (model, tuple((key, value) for key, value in entries if key not in given))
        for model, entries in values.get("model_overrides", ())
    )
    server_wide = {**{f.name: f.default for f in setting_fields()}, **values}
    check_group_conflicts(values["model_overrides"], values.get("group_tables", ()), server_wide, path)
    if bool(values.get("tls_cert_file")) != bool(values.get("tls_key_file")):
        raise ConfigError("HTTPS needs both DETECT_TLS_CERT_FILE (--tls-cert-file) and DETECT_TLS_KEY_FILE "
                          "(--tls-key-file), or neither")
    return Settings(**values)


def check_model_names(settings: Settings, known: list[str], config: Optional[Path] = None) -> list[str]:
    """Check that the [models.<name>] tables and default_model name models that are there.

    A file given with --config (`config`) is checked strictly: raise ConfigError. The shipped
    config/default.toml, read when no file is given, describes the shipped repository: where another
    repository is served, what it names that is not there is skipped, and the warnings are returned.
    """
    where = f"config file {config}" if config is not None else f"config file {DEFAULT_CONFIG}"
    problems = [f"{where}: [models.{name}] names no model; the models are {', '.join(known) or 'none'}"
                for name, _ in settings.model_overrides if name not in known]
    if settings.default_model and settings.default_model not in known and len(known) > 1:
        problems.append(f"setting DETECT_DEFAULT_MODEL (--default-model) names {settings.default_model!r}, which is "
                        f"not a model here; the models are {', '.join(known)}")
    if problems and config is not None:
        raise ConfigError(problems[0])
    return problems


def _parse(f: dataclasses.Field, raw: Any, source: str) -> Any:
    try:
        return f.metadata["parse"](raw)
    except ValueError as exc:
        shown = "(hidden)" if f.metadata.get("secret") else repr(str(raw))
        raise ConfigError(
            f"setting {env_name(f.name)} ({flag_name(f.name)}), from {source}, has value {shown}: {exc}"
        ) from None


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
