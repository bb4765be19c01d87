"""A second host for the tests: a network namespace joined to this one by a veth pair, so that a client in it
reaches the server from a non-loopback address, as a client on another machine would.

Made with `ip netns` and `ip link` (Debian's iproute2), which need root; `ForeignHost.make` raises
HostUnavailable, saying why, where they cannot be used. Each host has a /30 of its own in 10.213.0.0/16 and is
removed on close.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class HostUnavailable(RuntimeError):
    """A network namespace cannot be made here (not root, no iproute2, no netns support)."""


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *(["netns", "exec", namespace, "ip"] if namespace else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise HostUnavailable(f"{' '.join(command)} failed: {done.stderr.strip()[:200]}")


@dataclass
class ForeignHost:
    """A network namespace with one address (`address`) that reaches this host at `server_address`."""

    namespace: str
    address: str
    server_address: str
    _link: str

    @classmethod
    def make(cls, index: int = 0) -> "ForeignHost":
        if os.geteuid() != 0:
            raise HostUnavailable("making a network namespace needs root")
        if shutil.which("ip") is None:
            raise HostUnavailable("iproute2's ip is not installed")
        tag = f"{os.getpid() % 10000}{index}"
        namespace, link = f"detect-test-{tag}", f"dt{tag}"
        octet = (os.getpid() + index) % 60 * 4  # a /30 of its own
        server, client = f"10.213.{octet // 256}.{octet % 256 + 1}", f"10.213.{octet // 256}.{octet % 256 + 2}"
        _ip("netns", "add", namespace)
        host = cls(namespace, client, server, link)
        try:
            _ip("link", "add", link, "type", "veth", "peer", "name", link + "p")
            _ip("link", "set", link + "p", "netns", namespace)
            _ip("addr", "add", f"{server}/30", "dev", link)
            _ip("link", "set", link, "up")
            _ip("addr", "add", f"{client}/30", "dev", link + "p", namespace=namespace)
            _ip("link", "set", link + "p", "up", namespace=namespace)
            _ip("link", "set", "lo", "up", namespace=namespace)
        except HostUnavailable:
            host.close()
            raise
        return host

    def python(self, code: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run `code` in this venv's Python from the other host (the tests' helpers importable); its output."""
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
        return subprocess.run(["ip", "netns", "exec", self.namespace, sys.executable, "-c", code], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self._link], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, timeout=30)
