"""Hold GPU memory for scripts/gpu-check: allocate N MiB through CuPy or PyTorch, say so, and wait.

Run by tools/gpu_check/checks.py as a child process (never forked), one per holder. It imports nothing of
the project. The protocol is one JSON object per line:

- stdout, once the memory is held: {"event": "ready", "pid", "backend", "version", "device",
  "uuid", "allocated_mib"}; or, where it cannot be: {"event": "failed", "error"} and exit status 3.
  `--mib 0` holds a bare CUDA context (and the smallest block the allocator hands out).
- stdin: "libs" makes a cuBLAS call (and a cuDNN one where the backend has cuDNN), as a model's first
  call would, and answers {"event": "libs", "loaded": [...]}; "exit" or the end of stdin frees
  everything and exits 0. The end of stdin also comes when the checker dies, so no holder outlives it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import uuid as uuid_module

MIB = 2**20
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def say(**message) -> None:
    print(json.dumps(message), flush=True)


class TorchHolder:
    """Hold memory through PyTorch's caching allocator."""

    def __init__(self, device: int):
        import torch

        self.torch = torch
        self.version = torch.__version__
        if not torch.cuda.is_available():
            raise RuntimeError("PyTorch sees no CUDA device")
        self.device = torch.device("cuda", device)
        self.held = []

    def uuid(self):
        return str(self.torch.cuda.get_device_properties(self.device).uuid)

    def allocate(self, mib: int) -> None:
        # empty() maps the memory without a kernel; a bare context still gets its smallest block.
        self.held.append(self.torch.empty(max(mib * MIB, 1), dtype=self.torch.uint8, device=self.device))
        self.torch.cuda.synchronize(self.device)

    def load_libraries(self) -> list[str]:
        torch = self.torch
        loaded = []
        a = torch.ones(512, 512, device=self.device)
        self.held.append(a @ a)
        loaded.append("cublas")
        if torch.backends.cudnn.is_available():
            x = torch.ones(1, 3, 64, 64, device=self.device)
            self.held.append(torch.nn.functional.conv2d(x, torch.ones(8, 3, 3, 3, device=self.device)))
            loaded.append("cudnn")
        torch.cuda.synchronize(self.device)
        return loaded


class CupyHolder:
    """Hold memory through CuPy's memory pool."""

    def __init__(self, device: int):
        import cupy

        self.cupy = cupy
        self.version = cupy.__version__
        self.device = cupy.cuda.Device(device)
        self.device.use()
        self.held = []

    def uuid(self):
        raw = self.cupy.cuda.runtime.getDeviceProperties(self.device.id).get("uuid")
        return str(uuid_module.UUID(bytes=bytes(raw[:16]))) if raw else None

    def allocate(self, mib: int) -> None:
        self.held.append(self.cupy.empty(max(mib * MIB, 1), dtype=self.cupy.uint8))
        self.device.synchronize()

    def load_libraries(self) -> list[str]:
        cupy = self.cupy
        a = cupy.ones((512, 512), dtype=cupy.float32)
        self.held.append(a @ a)
        loaded = ["cublas"]
        try:
            from cupy.cuda import cudnn

            self.held.append(cudnn.create())  # a handle; CuPy has no plain convolution call
            loaded.append("cudnn (handle)")
        except Exception:  # CuPy without its cuDNN library: cuBLAS alone
            pass
        self.device.synchronize()
        return loaded


BACKENDS = {"torch": TorchHolder, "cupy": CupyHolder}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Hold GPU memory until told to exit (scripts/gpu-check's child).")
    parser.add_argument("--backend", choices=sorted(BACKENDS), required=True)
    parser.add_argument("--device", type=int, default=0, help="CUDA device, in PCI bus order (as NVML numbers it)")
    parser.add_argument("--mib", type=int, required=True, help="MiB to allocate; 0: a bare CUDA context")
    args = parser.parse_args(argv)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    try:
        holder = BACKENDS[args.backend](args.device)
        holder.allocate(args.mib)
        try:  # as NVML writes it without "GPU-"; None where the binding does not tell (the check is skipped)
            found = _UUID.search(str(holder.uuid()).lower())
            device_uuid = found.group(0) if found else None
        except Exception:
            device_uuid = None
    except Exception as exc:
        say(event="failed", error=f"{type(exc).__name__}: {exc}")
        return 3
    say(event="ready", pid=os.getpid(), backend=args.backend, version=holder.version, device=args.device,
        uuid=device_uuid, allocated_mib=args.mib)
    for line in sys.stdin:
        command = line.strip()
        if command == "exit":
            break
        if command == "libs":
            try:
                say(event="libs", loaded=holder.load_libraries())
            except Exception as exc:
                say(event="failed", error=f"{type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
