"""A stand-in for tools/gpu_check/holder.py on this GPU-less machine: the same flags and the same protocol.

It "holds" GPU memory by writing the MiB it would use (its allocation plus FAKE_CONTEXT_MIB) to
FAKE_GPU_DIR/<pid>, which the tests' NVML stand-in lists as a compute process on GPU 0; "libs" adds
FAKE_LIBS_MIB; exiting removes the file, unless its allocation is FAKE_LEAK_MIB (memory that never
comes back).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def hold(path: Path, mib: int) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(str(mib))
    os.replace(temporary, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--mib", type=int, required=True)
    args = parser.parse_args(argv)
    if args.backend == "broken":
        print(json.dumps({"event": "failed", "error": "RuntimeError: no CUDA device"}), flush=True)
        return 3
    path = Path(os.environ["FAKE_GPU_DIR"]) / str(os.getpid())
    used = args.mib + int(os.environ.get("FAKE_CONTEXT_MIB", "480"))
    hold(path, used)
    print(json.dumps({"event": "ready", "pid": os.getpid(), "backend": args.backend, "version": "0-fake",
                      "device": args.device, "uuid": "5a1c0d3e-0000-4000-8000-000000000000",
                      "allocated_mib": args.mib}), flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        if line.strip() == "libs":
            used += int(os.environ.get("FAKE_LIBS_MIB", "0"))
            hold(path, used)
            print(json.dumps({"event": "libs", "loaded": ["cublas", "cudnn"]}), flush=True)
    if str(args.mib) != os.environ.get("FAKE_LEAK_MIB"):
        path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
