"""A command that needs a package of an install extra that is missing says in one line which extra to install, and
exits 2: no traceback, and before any slow work. The package is made missing in a real subprocess of the CLI by
`sys.modules[name] = None`, which makes its import fail as if it were not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

BLOCKED_MAIN = "import sys; sys.modules[{module!r}] = None; from app.__main__ import main; sys.exit(main(sys.argv[1:]))"


def run_without(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m app <args>` with `module` unimportable."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    full_env.update({"TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
    return subprocess.run([sys.executable, "-c", BLOCKED_MAIN.format(module=module), *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=120)


def one_line_naming(extra: str, needed_by: str, module: str) -> str:
    return (f"error: {needed_by} needs {module}, which the '{extra}' extra installs: "
            f"pip install 'gpu-share-detect[{extra}]' (in a clone: .venv/bin/pip install -e '.[{extra}]')")


@pytest.mark.parametrize("module, args, env, extra, needed_by", [
    ("pycocotools", ["evaluate", "--images", "5"], {}, "tools", "python -m app evaluate"),
    ("matplotlib", ["calibrate", "--model", "{blob}", "--plot", "memory.png"], {}, "tools", "--plot"),
    ("OpenSSL", ["serve"], {"DETECT_TLS_CERT_FILE": "cert.pem", "DETECT_TLS_KEY_FILE": "key.pem"}, "tls",
     "HTTPS (tls_cert_file)"),
])
def test_a_command_needing_a_missing_extra_names_it_in_one_line_and_exits_2(module, args, env, extra, needed_by,
                                                                            blob_model_dir):
    result = run_without(module, *[a.format(blob=blob_model_dir) for a in args], env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [one_line_naming(extra, needed_by, module)], result.stderr
    assert "Traceback" not in result.stderr


def test_require_extra_passes_an_importable_module_and_names_the_extra_of_a_missing_one():
    """calibrate without --plot skips its default plot with this message rather than stopping."""
    from app.errors import MissingExtra
    from app.extras import require_extra

    with pytest.raises(MissingExtra, match=r"the plot needs no_such_plotting_module, which the 'tools' extra installs"):
        require_extra("tools", "no_such_plotting_module", "the plot")
    require_extra("tools", "json", "the plot")  # an importable module passes
