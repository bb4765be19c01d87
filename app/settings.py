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
from .memory_policy import MemorySpec, parse_gpu_list, parse_memory_spec

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


def _log_level(value: Any) -> str:
    level = str(value).strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
    return level


def _setting(default: Any, parse: Callable[[Any], Any], help: str) -> Any:
    return field(default=default, metadata={"parse": parse, "help": help})


@dataclass(frozen=True)
class Settings:
    """Every setting of the service; built once at boot, then read-only."""

    host: str = _setting("127.0.0.1", _text, "interface to listen on")
    port: int = _setting(8000, _int_in(0, 65535), "TCP port to listen on (0: any free port, logged at boot)")
    model: str = _setting(
        "models/faces", _text, "model base path (serves its highest numeric version) or one version folder"
    )
    gpu_memory: MemorySpec = _setting(
        parse_memory_spec("4GiB"), parse_memory_spec,
        "GPU memory policy: greedy, growth, a cap (4096, 4096MiB, 4GiB) or a share (25%)",
    )
    gpus: Optional[tuple[int, ...]] = _setting(
        None, parse_gpu_list, "physical GPUs this process may use ('' all, 'none', or '0,1')"
    )
    max_images_per_request: int = _setting(16, _int_in(1, 256), "most images one /detect request may carry")
    default_threshold: float = _setting(0.5, _float_in(0.0, 1.0), "score threshold when the request gives none")
    max_body_bytes: int = _setting(
        20 * 2**20, _bytes_in(1024, 2**31), "largest request body, chunked bodies included (bytes, or 20MiB)"
    )
    max_image_pixels: int = _setting(
        40_000_000, _int_in(1, 2**31), "largest image, width x height, checked from the header before decoding"
    )
    http_threads: int = _setting(
        128, _int_in(1, 1024), "WSGI threads: /detect requests admitted at once; beyond, 503 with Retry-After"
    )
    idle_timeout_s: float = _setting(60.0, _float_in(1.0, 3600.0), "close a connection idle this long (s)")
    shutdown_grace_s: float = _setting(
        20.0, _float_in(0.0, 600.0), "on SIGTERM, wait this long for requests in flight (s)"
    )
    log_level: str = _setting("INFO", _log_level, "DEBUG, INFO, WARNING or ERROR")
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
    # parallelism overlap the other's; on 2 CPU cores 16 x 2 beat 32 x 1 by 18% (README, Measured figures).
    inference_threads: int = _setting(2, _int_in(1, 64), "model calls that may run at once")
    max_queue: int = _setting(
        128, _int_in(1, 100000), "images that may wait for the model; beyond it /detect answers 503 with Retry-After"
    )
    request_deadline_s: float = _setting(
        30.0, _float_in(0.1, 3600.0), "longest a /detect request may wait for its answers before 504 (s)"
    )
    header_timeout_s: float = _setting(
        10.0, _float_in(0.5, 600.0), "close a connection whose request line and headers take longer (s)"
    )
    body_timeout_s: float = _setting(
        30.0, _float_in(0.5, 3600.0), "close a connection whose body takes longer than this to arrive (s)"
    )
    # Set by `python -m app fleet` on each instance it starts; /gpu reads them to account per process.
    fleet_state: str = _setting(
        "", lambda value: str(value).strip(), "fleet state file (JSON) naming each instance's pid and caps ('' none)"
    )
    instance_name: str = _setting("", lambda value: str(value).strip(), "this instance's name in its fleet ('' none)")


def env_name(name: str) -> str:
    """Return the environment variable for a setting, e.g. DETECT_GPU_MEMORY."""
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    """Return the command-line flag for a setting, e.g. --gpu-memory."""
    return "--" + name.replace("_", "-")


def setting_fields() -> list[dataclasses.Field]:
    """Return the dataclass fields of Settings, each with its parser and help text."""
    return list(dataclasses.fields(Settings))


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
            if key not in by_name:
                raise ConfigError(
                    f"config file {path} has unknown setting {key!r}; known settings: {', '.join(by_name)}"
                )
            values[key] = _parse(by_name[key], raw, f"{key} in {path}")

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

    for name, raw in (flags or {}).items():
        if raw is None:
            continue
        if name not in by_name:
            raise ConfigError(f"unknown setting {name!r}")
        values[name] = _parse(by_name[name], raw, flag_name(name))

    return Settings(**values)


def _parse(f: dataclasses.Field, raw: Any, source: str) -> Any:
    try:
        return f.metadata["parse"](raw)
    except ValueError as exc:
        raise ConfigError(
            f"setting {env_name(f.name)} ({flag_name(f.name)}), from {source}, has value {str(raw)!r}: {exc}"
        ) from None


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
