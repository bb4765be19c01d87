"""A process tree's memory from /proc: resident (VmRSS) and proportional (Pss) set sizes, summed.

RSS counts every shared page once per process that maps it, so a tree of processes that all load
TensorFlow (the same 500 MB of libraries) is overstated by it; PSS divides each shared page among the
processes that map it, so the tree's PSS is what the tree costs the machine. Both are read: VmRSS from
/proc/<pid>/status, Pss from /proc/<pid>/smaps_rollup.

A tree is the leader and its descendants (by parent pid), plus every process in the leader's session:
Ray's raylet starts its actors in process groups of their own, and a daemon may be re-parented to init,
but neither leaves the session it was started in.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Optional

PROC = Path("/proc")


def _stat(pid: int) -> Optional[tuple[str, int, int]]:
    """Return (state, parent pid, session id) of a process, or None if it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[3])


def tree(leader: int) -> list[int]:
    """Return the live (not zombie) processes of a leader's tree: its descendants and its session's members."""
    table = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            found = _stat(int(entry.name))
            if found is not None:
                table[int(entry.name)] = found
    members = {pid for pid, (_, _, sid) in table.items() if sid == leader}
    if leader in table:
        members.add(leader)
    added = True
    while added:  # descendants that left the session (setsid) are still the tree's
        more = {pid for pid, (_, ppid, _) in table.items() if ppid in members and pid not in members}
        members |= more
        added = bool(more)
    return sorted(pid for pid in members if table[pid][0] != "Z")


def memory(pid: int) -> Optional[dict]:
    """Return {"rss_mib", "pss_mib"} of one process, or None if it is gone or a zombie."""
    try:
        status = (PROC / str(pid) / "status").read_text()
        rollup = (PROC / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return None
    rss = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    pss = re.search(r"^Pss:\s+(\d+) kB", rollup, re.M)
    if rss is None or pss is None:
        return None
    return {"rss_mib": int(rss.group(1)) / 1024, "pss_mib": int(pss.group(1)) / 1024}


def sample(leader: int) -> dict:
    """Return the tree's summed RSS and PSS (MiB) and its process count, now."""
    figures = [m for m in (memory(pid) for pid in tree(leader)) if m is not None]
    return {"rss_mib": round(sum(m["rss_mib"] for m in figures), 1),
            "pss_mib": round(sum(m["pss_mib"] for m in figures), 1),
            "processes": len(figures)}


class Tree:
    """A leader's tree as scripts/bench.py's StatsSampler samples a server: `stats()` now; every pid seen kept."""

    def __init__(self, leader: int):
        self.leader = leader
        self.seen: set[int] = set()  # every pid of the tree ever sampled, for `stop`

    def stats(self) -> dict:
        self.seen.update(tree(self.leader))
        return sample(self.leader)


def peak(samples: list[dict]) -> dict:
    """The largest RSS, PSS and process count among samples (each its own maximum)."""
    return {key: max((s[key] for s in samples), default=0) for key in ("rss_mib", "pss_mib", "processes")}


def stop(leader: int, seen: set[int] = frozenset(), timeout_s: float = 30.0) -> dict:
    """SIGTERM the leader; after timeout_s SIGKILL whatever of its tree (or of `seen`) is left.

    Return {"exit": how it ended, "killed": pids killed, "left": pids still alive after the kill}.
    """
    try:
        os.kill(leader, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(leader, seen):
        time.sleep(0.2)
    left = _alive(leader, seen)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.5 if left else 0)
    return {"exit": "killed" if left else "terminated", "killed": left, "left": _alive(leader, seen)}


def _alive(leader: int, seen) -> list[int]:
    """Live processes of the tree, and of `seen` still in the leader's session (pids are reused)."""
    alive = set(tree(leader))
    for pid in seen:
        found = _stat(pid)
        if found is not None and found[0] != "Z" and found[2] == leader:
            alive.add(pid)
    return sorted(alive)
