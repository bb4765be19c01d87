"""How a model executes: its precision (fp32, bf16, fp16), chosen for the hardware at hand and applied to TensorFlow.

Triton calls these execution accelerators. Two of TensorFlow's graph rewrites (Grappler) do the work
on an unchanged SavedModel:

- bf16: `auto_mixed_precision_onednn_bfloat16` runs the CPU's matrix work (convolutions, matmuls) in
  bfloat16 through oneDNN, keeping fp32 where precision matters (softmax, sums). Fast only on a CPU
  with native bf16 (`avx512_bf16`, or AMX); on other AVX-512 CPUs oneDNN emulates it, slower than fp32,
  and without AVX-512 TensorFlow does not rewrite the graph at all.
- fp16: `auto_mixed_precision` does the same in float16 on a GPU; fast on tensor cores (compute
  capability 7.0 and up).

XLA (auto-clustering) is not offered: here it made objects slower and shapes 1.2x faster on image sizes it
had compiled for, but it compiles again for every new image size (90 to 880 ms a time, and the service
takes any size), and on faces it aborts the process from inside XLA, which no gate can catch
(docs/concepts/precision.md).

Both switches are the process's (TensorFlow's context options), which is why each model has a worker
of its own: a worker applies its model's choice and nothing else shares it. They act on the next call,
also of a function already loaded, so the parity gate (app/inference/parity.py) runs fp32 and the
reduced precision one after the other in the same worker.

TensorFlow is reached through `tf_config` (tf.config, or the GPU stand-in in the tests): this module
is where the precision settings meet TensorFlow, and nothing else of the service sets them
(tools/precision.py turns XLA on itself, to measure it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# CPU flags (/proc/cpuinfo) that mean native bf16 arithmetic: AVX-512 BF16 (Cooper Lake, Zen 4 and later) or AMX.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# What TensorFlow's oneDNN bf16 rewrite needs at all (its IsBF16SupportedByOneDNNOnThisCPU): without one of these
# it leaves the graph in fp32, so bf16 asked on such a CPU is served, and reported, as fp32.
BF16_KERNEL_FLAGS = ("avx512f", "avx_ne_convert", "amx_bf16")
TENSOR_CORES = (7, 0)  # the first compute capability with tensor cores (Volta)


@dataclass(frozen=True)
class Gpu:
    """A GPU TensorFlow may use, as tf.config describes it."""

    name: str
    compute_capability: Optional[tuple[int, int]]  # None where TensorFlow does not say

    @property
    def tensor_cores(self) -> bool:
        return self.compute_capability is not None and tuple(self.compute_capability) >= TENSOR_CORES


@dataclass(frozen=True)
class Hardware:
    """What the choice of precision depends on: the GPUs TensorFlow will run on, and the CPU's flags."""

    gpus: tuple[Gpu, ...]
    cpu_flags: frozenset[str]
    cpu_name: str = ""

    @property
    def native_bf16(self) -> bool:
        return any(flag in self.cpu_flags for flag in NATIVE_BF16_FLAGS)

    @property
    def bf16_kernels(self) -> bool:
        """Whether oneDNN runs bf16 here at all: natively, or emulated on AVX-512 (slower than fp32)."""
        return any(flag in self.cpu_flags for flag in BF16_KERNEL_FLAGS)

    def describe(self) -> str:
        if self.gpus:
            return ", ".join(f"{g.name} (compute capability {_cc(g)})" for g in self.gpus)
        has = [flag for flag in NATIVE_BF16_FLAGS if flag in self.cpu_flags]
        return f"CPU {self.cpu_name or 'unknown'}" + (f" with {', '.join(has)}" if has else ", no native bf16")


def _cc(gpu: Gpu) -> str:
    return "unknown" if gpu.compute_capability is None else ".".join(str(n) for n in gpu.compute_capability)


def read_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[frozenset[str], str]:
    """Return the CPU's flags and model name from /proc/cpuinfo (empty where it cannot be read)."""
    flags: frozenset[str] = frozenset()
    name = ""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return flags, name
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = frozenset(value.split())
        elif key == "model name" and not name:
            name = value.strip()
    return flags, name


def read_hardware(tf_config=None, cpuinfo: Path = Path("/proc/cpuinfo")) -> Hardware:
    """Read the GPUs TensorFlow will run on (after the memory policy chose them) and the CPU's flags."""
    if tf_config is None:
        import tensorflow as tf

        tf_config = tf.config
    gpus = []
    for device in tf_config.get_visible_devices("GPU"):
        try:
            details = tf_config.experimental.get_device_details(device) or {}
        except Exception:  # details are a nicety; a GPU without them still counts
            details = {}
        capability = details.get("compute_capability")
        gpus.append(Gpu(details.get("device_name") or device.name,
                        tuple(capability) if capability is not None else None))
    flags, name = read_cpu(cpuinfo)
    return Hardware(tuple(gpus), flags, name)


def choose_precision(asked: str, hardware: Hardware) -> tuple[str, str]:
    """Return the precision to run at and why, for a model that asks for `asked` on this hardware."""
    if asked not in PRECISIONS:
        raise ValueError(f"precision {asked!r} is not one of {', '.join(PRECISIONS)}")
    if asked == "fp32":
        return "fp32", "fp32 asked"
    if hardware.gpus:
        if asked == "bf16":
            return "fp32", ("bf16 is a CPU mode (oneDNN) and this model runs on a GPU, where TensorFlow's automatic "
                            "mixed precision is fp16: ask for fp16 or auto")
        if asked == "fp16":
            return "fp16", "fp16 asked, on " + hardware.describe()
        if all(g.tensor_cores for g in hardware.gpus):
            return "fp16", "auto: fp16 on tensor cores, " + hardware.describe()
        return "fp32", f"auto: fp32, since {hardware.describe()} has no tensor cores (compute capability 7.0 and up)"
    if asked == "fp16":
        return "fp32", "fp16 needs a GPU: TensorFlow's automatic fp16 rewrites GPU kernels only"
    if asked == "bf16":
        if hardware.native_bf16:
            return "bf16", "bf16 asked, on " + hardware.describe()
        if hardware.bf16_kernels:
            return "bf16", (f"bf16 asked, on {hardware.describe()}: oneDNN emulates bf16 there, which is slower "
                            "than fp32")
        return "fp32", (f"bf16 asked, but on {hardware.describe()} TensorFlow's oneDNN has no bf16 kernels (they "
                        "need AVX-512, AVX-NE-CONVERT or AMX), so it serves fp32")
    if hardware.native_bf16:
        return "bf16", "auto: bf16 through oneDNN, on " + hardware.describe()
    return "fp32", f"auto: fp32, since {hardware.describe()}: emulated bf16 would be slower"


def optimizer_options(precision: str) -> dict[str, bool]:
    """Grappler's options for a precision: each rewrite named, on or off."""
    return {"auto_mixed_precision": precision == "fp16",
            "auto_mixed_precision_onednn_bfloat16": precision == "bf16"}


def apply_precision(precision: str, tf_config=None) -> None:
    """Make TensorFlow run this process's next calls at `precision`."""
    if tf_config is None:
        import tensorflow as tf

        tf_config = tf.config
    tf_config.optimizer.set_experimental_options(optimizer_options(precision))
