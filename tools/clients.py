"""The field's own clients, unmodified: Triton's perf_analyzer and KServe's Python SDK, for the tests and for
the perf_analyzer table (tools/perf_table.py).

Both are set up on first use and kept under `.cache/clients/` (git-ignored), so a fresh CI machine makes
them once and a rerun reuses them:

- perf_analyzer 2.60 ships as a binary inside tritonclient's 2.60.0 manylinux wheel, built against glibc 2.38
  and a newer libstdc++ than Debian bookworm has. It runs under Debian trixie's own loader and libraries,
  fetched with a private apt configuration (its own sources list, state and cache under the cache folder,
  pointed at this machine's Debian mirror) and unpacked with `dpkg -x`: nothing is installed system-wide.
- KServe's SDK pins its own protobuf and grpcio, which conflict with the server's, so it gets a virtual
  environment of its own; the tests run small snippets in it (`run_kserve_client`).

Set-up that cannot reach a registry or a mirror raises `ClientUnavailable` saying why; the fixtures turn that
into a skip, as the project's other tests that need an outside tool do.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "clients"

TRITON_CLIENT = "tritonclient==2.60.0"  # Triton 25.08; its wheel carries perf_analyzer 2.60.0
PERF_ANALYZER_IN_WHEEL = "tritonclient-2.60.0.data/data/bin/perf_analyzer"
# What perf_analyzer links (readelf -d): glibc, libstdc++ and libgcc_s at trixie's versions; OpenSSL and zlib
# from trixie too, so that the folder does not depend on what the machine has.
TRIXIE_PACKAGES = ("libc6", "libstdc++6", "libgcc-s1", "libssl3t64", "zlib1g")
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"  # every current release's key, trixie's too
KSERVE = "kserve==0.21.0"

PIP_TIMEOUT_S = 900.0  # the KServe SDK's dependencies on a cold machine
APT_TIMEOUT_S = 300.0


class ClientUnavailable(RuntimeError):
    """A client could not be set up here (no registry, no mirror, no apt); the message says which step failed."""


# perf_analyzer ------------------------------------------------------------------------------------------------

def perf_analyzer_command() -> list[str]:
    """Return the argv prefix that starts perf_analyzer 2.60 under trixie's loader, setting it up on first use."""
    folder = CACHE / "perf_analyzer"
    stamp = folder / ".ready"
    with _locked(CACHE / ".perf_analyzer.lock"):
        if not _stamp_matches(stamp, _perf_analyzer_recipe()):
            _build_perf_analyzer(folder)
            _write_stamp(stamp, _perf_analyzer_recipe())
    return _perf_analyzer_argv(folder)


def _perf_analyzer_recipe() -> str:
    return f"{TRITON_CLIENT} trixie {' '.join(TRIXIE_PACKAGES)}"


def _perf_analyzer_argv(folder: Path) -> list[str]:
    libraries = folder / "trixie" / "usr" / "lib" / "x86_64-linux-gnu"
    return [str(libraries / "ld-linux-x86-64.so.2"), "--library-path", str(libraries),
            str(folder / "bin" / "perf_analyzer")]


def _build_perf_analyzer(folder: Path) -> None:
    """Fetch the wheel's binary and trixie's libraries into a fresh `folder`; check that the binary runs."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise ClientUnavailable("perf_analyzer needs Debian's apt-get and dpkg to fetch trixie's glibc")
    shutil.rmtree(folder, ignore_errors=True)
    work = folder / "download"
    (folder / "bin").mkdir(parents=True)
    wheels = work / "wheel"
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
          "--platform", "manylinux1_x86_64", "--dest", str(wheels), TRITON_CLIENT],
         PIP_TIMEOUT_S, f"pip could not download {TRITON_CLIENT}")
    (wheel,) = wheels.glob("tritonclient-*.whl")
    with zipfile.ZipFile(wheel) as archive, archive.open(PERF_ANALYZER_IN_WHEEL) as source, \
            (folder / "bin" / "perf_analyzer").open("wb") as target:
        shutil.copyfileobj(source, target)
    (folder / "bin" / "perf_analyzer").chmod(0o755)

    apt = _private_apt(work / "apt")
    _run(apt + ["update"], APT_TIMEOUT_S, "apt-get update of the trixie suite failed")
    debs = work / "debs"
    debs.mkdir()
    _run(apt + ["download", *TRIXIE_PACKAGES], APT_TIMEOUT_S, "apt-get download from trixie failed", cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg", "-x", str(deb), str(folder / "trixie")], 120.0, f"dpkg -x {deb.name} failed")
    shutil.rmtree(work)

    done = subprocess.run(_perf_analyzer_argv(folder) + ["--version"], capture_output=True, text=True, timeout=60)
    if "Perf Analyzer Version 2.60" not in done.stdout + done.stderr:
        raise ClientUnavailable(f"perf_analyzer does not start under trixie's loader (exit {done.returncode}):\n"
                                f"{done.stdout}{done.stderr}")


def _private_apt(state: Path) -> list[str]:
    """Return an apt-get argv whose sources, state, lists and cache are all under `state`: trixie on this mirror."""
    mirror = debian_mirror()
    for sub in ("lists/partial", "cache/archives/partial", "etc/sources.list.d", "etc/preferences.d"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "status").touch()
    sources = state / "etc" / "trixie.sources"
    sources.write_text(f"Types: deb\nURIs: {mirror}\nSuites: trixie\nComponents: main\nSigned-By: {DEBIAN_KEYRING}\n")
    options = {
        "Dir::Etc::SourceList": sources, "Dir::Etc::SourceParts": state / "etc" / "sources.list.d",
        "Dir::Etc::Preferences": state / "etc" / "preferences",
        "Dir::Etc::PreferencesParts": state / "etc" / "preferences.d",
        "Dir::State": state, "Dir::State::Lists": state / "lists", "Dir::State::status": state / "status",
        "Dir::Cache": state / "cache", "Debug::NoLocking": "1", "Acquire::Languages": "none",
        "APT::Architecture": "amd64", "APT::Architectures": "amd64",
        # apt drops to the _apt user to fetch, who cannot write into a folder that root made in the checkout
        "APT::Sandbox::User": "root" if os.geteuid() == 0 else "",
    }
    return ["apt-get", "-q"] + [arg for key, value in options.items() if value for arg in ("-o", f"{key}={value}")]


def debian_mirror(etc: Path = Path("/etc/apt")) -> str:
    """Return the URI of the first Debian archive this machine's apt sources name; deb.debian.org if none."""
    for path in [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*"))]:
        if not path.is_file() or path.suffix not in (".list", ".sources"):
            continue
        for uri, suites in _source_entries(path.read_text(errors="replace"), path.suffix == ".sources"):
            # The main archive, not its security updates: the one whose first suite is a codename like bookworm.
            if suites and re.fullmatch(r"[a-z]+", suites[0]) and "security" not in uri:
                return uri.rstrip("/")
    return "http://deb.debian.org/debian"


def _source_entries(text: str, deb822: bool):
    """Yield (URI, suites) for each `deb` entry of a sources file, one-line or deb822."""
    if not deb822:
        for line in text.splitlines():
            words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()  # without [options]
            if words[:1] == ["deb"] and len(words) >= 3:
                yield words[1], words[2:3]
        return
    for stanza in re.split(r"\n\s*\n", text):
        fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M))
        if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
            for uri in fields.get("URIs", "").split():
                yield uri, fields.get("Suites", "").split()


# KServe's Python SDK ------------------------------------------------------------------------------------------

def kserve_python() -> Path:
    """Return the python of a virtual environment holding KServe's SDK 0.21, making it on first use."""
    venv = CACHE / "kserve-venv"
    stamp = venv / ".ready"
    with _locked(CACHE / ".kserve-venv.lock"):
        if not _stamp_matches(stamp, KSERVE):
            shutil.rmtree(venv, ignore_errors=True)
            _run([sys.executable, "-m", "venv", str(venv)], 120.0, "python -m venv failed")
            _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", KSERVE], PIP_TIMEOUT_S,
                 f"pip could not install {KSERVE}")
            _write_stamp(stamp, KSERVE)
    return venv / "bin" / "python"


def run_kserve_client(python: Path, code: str, url: str, arrays: dict | None = None, timeout: float = 60.0):
    """Run `code` in the KServe venv against `url`; return the value it hands to `emit`, as JSON.

    The snippet is the body of an async function (KServe's clients are async) that sees `URL`, `ARRAYS` (the
    numpy `arrays`, passed through an .npz file), `np`, `kserve` and `emit`; an exception fails with the
    snippet's traceback.
    """
    body = "\n".join("    " + line for line in code.strip().splitlines())
    script = (
        "import asyncio, io, json, sys\nimport numpy as np\nimport kserve\n"
        "URL = sys.argv[1]\nARRAYS = dict(np.load(io.BytesIO(sys.stdin.buffer.read())))\n"
        "def emit(value):\n    print('\\nRESULT ' + json.dumps(value), flush=True)\n"
        f"async def main():\n{body}\n"
        "asyncio.run(main())\n"
    )
    packed = io.BytesIO()
    np.savez(packed, **(arrays or {}))
    done = subprocess.run([str(python), "-c", script, url], input=packed.getvalue(), capture_output=True,
                          timeout=timeout)
    stdout, stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    if done.returncode != 0:
        raise AssertionError(f"the KServe SDK snippet failed (exit {done.returncode}):\n{stderr[-2500:]}")
    results = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"the snippet emitted nothing:\n{stdout[-2000:]}{stderr[-2000:]}"
    return json.loads(results[-1])


# Shared -------------------------------------------------------------------------------------------------------

@contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on `path` so that two test processes do not build the same folder at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _stamp_matches(stamp: Path, recipe: str) -> bool:
    return stamp.is_file() and stamp.read_text().strip() == recipe


def _write_stamp(stamp: Path, recipe: str) -> None:
    stamp.write_text(recipe + "\n")


def _run(argv: list[str], timeout: float, what: str, cwd: Path | None = None) -> None:
    """Run a set-up step; raise ClientUnavailable with `what` and the step's output if it fails or hangs."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ClientUnavailable(f"{what}: {error}") from error
    if done.returncode != 0:
        raise ClientUnavailable(f"{what} (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
