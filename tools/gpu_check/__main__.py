"""`python -m tools.gpu_check`: the GPU check (scripts/gpu-check runs this with python3 as found)."""

import platform
import sys

# Before the checks' import: they, and the `app` modules they use, need Python 3.11.
if sys.version_info < (3, 11):
    sys.exit(f"gpu-check: cannot run here: it needs Python 3.11 or later, not {platform.python_version()}")

from tools.gpu_check.checks import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
