"""Process-wide setup, done once where a process starts rather than as a side effect of an import.

`configure_cuda_order` and `quiet_tensorflow_startup` run in every process that may load TensorFlow (model
workers, training, calibration); `configure_pillow` and `configure_allocator` in every process that decodes uploads (the HTTP
process, benchmarks).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import re
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator, Mapping, Optional

# Pillow inflates PNG text chunks (tEXt, zTXt, iTXt) at open, up to 1 MiB each and 64 MiB in all; 64 MiB per
# image, in each of the request threads at once, is memory and time no detection needs. 4 MiB keeps any real
# metadata (XMP, comments) and turns a pile of 1 MiB text bombs into a quick 400.
PNG_TEXT_MEMORY_CHUNKS = 4


def configure_cuda_order(environ=None) -> None:
    """Number GPUs as nvidia-smi and NVML do (PCI bus order), before CUDA initializes.

    CUDA's default order is "fastest first", so without this DETECT_GPUS=1 could be another GPU than
    nvidia-smi's GPU 1.
    """
    (os.environ if environ is None else environ).setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


def quiet_tensorflow_startup(environ=None) -> None:
    """Keep TensorFlow's C++ INFO and WARNING lines out of the log, its errors in, unless the user chose a level.

    Before TensorFlow is imported. On a CPU host each worker otherwise starts with "Could not find cuda drivers",
    oneDNN and CPU-feature notices, and each warm-up adds grappler's "Error in PredictCost()" warnings: notices,
    not failures. TF_CPP_MIN_LOG_LEVEL=0 in the environment brings them back.
    """
    (os.environ if environ is None else environ).setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# What TensorFlow's native libraries write while they load, before TF_CPP_MIN_LOG_LEVEL is read (their static
# initializers log through absl): INFO lines ("I0000 00:00:1796563515.197510   20385 port.cc:153] oneDNN custom
# operations are on...", "cudart_stub.cc:31] Could not find cuda drivers...") and absl's notice that it was not set up.
_ABSL_INFO = re.compile(rb"^I\d{4} [\d:.]+ +\d+ [\w./-]+:\d+\] ")
_ABSL_NOTICE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


def is_load_notice(line: bytes) -> bool:
    """Return whether a stderr line is one of the INFO notices TensorFlow's libraries print as they load."""
    return bool(_ABSL_INFO.match(line)) or line.rstrip(b"\r\n") == _ABSL_NOTICE


@contextmanager
def tensorflow_load_notices_dropped(environ: Optional[Mapping[str, str]] = None) -> Iterator[None]:
    """Drop the INFO notices native code writes to stderr (fd 2) inside the block; pass every other line on after it.

    For `import tensorflow` in a worker, where TF_CPP_MIN_LOG_LEVEL (1 or more) hides INFO: warnings, errors and
    Python's own output come through, and a crash inside still reaches the real stderr (faulthandler is pointed
    at it). With TF_CPP_MIN_LOG_LEVEL unset or 0, nothing is dropped.
    """
    environ = os.environ if environ is None else environ
    if environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip() in ("", "0"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    real_stderr = os.fdopen(saved, "wb", buffering=0, closefd=False)
    crash_trace = faulthandler.is_enabled()
    captured = tempfile.TemporaryFile()
    os.dup2(captured.fileno(), 2)
    if crash_trace:
        faulthandler.enable(file=real_stderr)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        if crash_trace:
            faulthandler.enable()
        captured.seek(0)
        kept = b"".join(line for line in captured if not is_load_notice(line))
        if kept:
            os.write(2, kept)
        captured.close()
        real_stderr.close()
        os.close(saved)


def configure_pillow() -> None:
    """Set Pillow's process-wide decoding limits for untrusted uploads."""
    from PIL import Image, PngImagePlugin

    # The service checks max_image_pixels itself, from the header, before decoding; Pillow's own bomb check
    # would otherwise warn or raise at its fixed limit, whatever the setting says.
    Image.MAX_IMAGE_PIXELS = None
    PngImagePlugin.MAX_TEXT_MEMORY = PNG_TEXT_MEMORY_CHUNKS * PngImagePlugin.MAX_TEXT_CHUNK


# glibc's mallopt() parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

# What the request threads' decoding needs from glibc's allocator. A decode allocates a few buffers of about a
# megabyte (the JPEG's pixels, the RGB image, the array); with glibc's defaults the request threads' arenas gave
# them back to the kernel after every request and faulted them in again on the next: 700 page faults and
# 1.5 ms a request on a 640x480 JPEG (docs/concepts/latency.md). Buffers under MMAP_THRESHOLD come from the
# heap, and a heap keeps up to TRIM_THRESHOLD free at its top; ARENA_MAX heaps bound what is kept to
# ARENA_MAX x TRIM_THRESHOLD, 64 MiB, whatever the number of request threads.
ALLOCATOR_OPTIONS = {M_MMAP_THRESHOLD: 4 << 20, M_TRIM_THRESHOLD: 16 << 20, M_ARENA_MAX: 4}

# Environment variables by which a user tunes glibc's allocator; where one is set, theirs is the choice.
ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "MALLOC_TOP_PAD_",
                       "GLIBC_TUNABLES", "LD_PRELOAD")


def configure_allocator(environ: Optional[Mapping[str, str]] = None) -> str:
    """Keep the decoding buffers of request threads in the heap between requests; return what was done.

    glibc only (elsewhere mallopt is absent and nothing changes), and only where the environment does not
    tune the allocator itself (ALLOCATOR_VARIABLES: MALLOC_* settings, GLIBC_TUNABLES, a preloaded jemalloc or
    tcmalloc). Setting the thresholds turns off glibc's own adjustment of them, which is what let the
    buffers go back to the kernel.
    """
    environ = os.environ if environ is None else environ
    chosen = sorted(name for name in ALLOCATOR_VARIABLES if environ.get(name))
    if chosen:
        return f"left as the environment sets it ({', '.join(chosen)})"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc, whose mallopt these parameters are for)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "left alone (not glibc)"
    refused = [param for param, value in ALLOCATOR_OPTIONS.items() if mallopt(param, value) != 1]
    if refused:
        return f"glibc refused mallopt parameters {refused}"
    return ("glibc: buffers under 4 MiB from the heap, 16 MiB kept free per heap, at most 4 heaps")
