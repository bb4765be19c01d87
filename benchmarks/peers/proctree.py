"""A process tree's memory from /proc: its resident pages counted once, and RSS and PSS summed.

- `unique_mib`: the physical pages the tree's processes have resident, each counted once however many of
  them map it (the union of the page frame numbers in /proc/<pid>/pagemap; reading frame numbers needs
  root, else it is None). This is what the tree holds in memory, shared libraries included once.
- `rss_mib`: VmRSS summed. It counts a page once per process that maps it, so a tree of processes that
  all load TensorFlow (the same libraries) is overstated by it.
- `pss_mib`: Pss (/proc/<pid>/smaps_rollup) summed. Each shared page is divided among every process on
  the machine that maps it, inside the tree or not: a tree whose TensorFlow comes from the same files as
  another program's looks smaller while that program runs. Kept for comparison only.

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
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: int) -> Optional[tuple[str, int, int, int]]:
    """Return (state, parent pid, session id, start time in clock ticks) of a process, or None if it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def identities(pids) -> dict[int, int]:
    """Map each live pid to its start time: with it, a pid reused by a new process is not taken for the old."""
    found = {pid: _stat(pid) for pid in pids}
    return {pid: stat[3] for pid, stat in found.items() if stat is not None}


def tree(leader: int) -> list[int]:
    """Return the live (not zombie) processes of a leader's tree: its descendants and its session's members."""
    table = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            found = _stat(int(entry.name))
            if found is not None:
                table[int(entry.name)] = found
    members = {pid for pid, (_, _, sid, _) in table.items() if sid == leader}
    if leader in table:
        members.add(leader)
    added = True
    while added:  # descendants that left the session (setsid) are still the tree's
        more = {pid for pid, (_, ppid, _, _) in table.items() if ppid in members and pid not in members}
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


def frames(pid: int):
    """Return the page frame numbers of a process's resident pages (a NumPy array), or None without root."""
    import numpy as np

    found = []
    try:
        maps = (PROC / str(pid) / "maps").read_text().splitlines()
        with open(PROC / str(pid) / "pagemap", "rb", buffering=0) as pagemap:
            for line in maps:
                start, end = (int(x, 16) // PAGE for x in line.split(None, 1)[0].split("-"))
                try:
                    pagemap.seek(start * 8)
                    entries = np.frombuffer(pagemap.read((end - start) * 8), dtype=np.uint64)
                except (OSError, ValueError):
                    continue  # [vsyscall] and the like
                found.append(entries[(entries >> np.uint64(63)) == 1] & np.uint64((1 << 55) - 1))
    except OSError:
        return np.zeros(0, np.uint64)  # it exited meanwhile
    resident = np.concatenate(found) if found else np.zeros(0, np.uint64)
    if resident.size and not resident.any():
        return None  # present pages with frame number 0: the kernel hides frames from non-root readers
    return resident


def unique_mib(pids: list[int]) -> Optional[float]:
    """The tree's resident pages, each counted once (MiB); None where frame numbers cannot be read."""
    import numpy as np

    per = [frames(pid) for pid in pids]
    if any(f is None for f in per):
        return None
    return round(np.unique(np.concatenate(per)).size * PAGE / 2**20, 1) if per else 0.0


def sample(leader: int, unique: bool = False) -> dict:
    """Return the tree's summed RSS and PSS (MiB) and its process count, now; with `unique`, unique_mib too."""
    pids = tree(leader)
    figures = [m for m in (memory(pid) for pid in pids) if m is not None]
    out = {"rss_mib": round(sum(m["rss_mib"] for m in figures), 1),
           "pss_mib": round(sum(m["pss_mib"] for m in figures), 1),
           "processes": len(figures)}
    if unique:
        out["unique_mib"] = unique_mib(pids)
    return out


class Tree:
    """A leader's tree as tools/samplers.py's StatsSampler samples a server: `stats()` now; every pid seen kept."""

    def __init__(self, leader: int, unique_every: int = 4):
        self.leader = leader
        self.seen: dict[int, int] = {}  # every process of the tree ever sampled (pid: start time), for `stop`
        self._calls = 0
        self._unique_every = unique_every  # reading every page table takes a while: every n-th sample only

    def stats(self) -> dict:
        self.seen.update(identities(tree(self.leader)))
        self._calls += 1
        return sample(self.leader, unique=self._calls % self._unique_every == 0)


def peak(samples: list[dict]) -> dict:
    """The largest of each figure among samples (each its own maximum; unique_mib None if never read)."""
    out = {key: max((s[key] for s in samples), default=0) for key in ("rss_mib", "pss_mib", "processes")}
    unique = [s["unique_mib"] for s in samples if s.get("unique_mib") is not None]
    out["unique_mib"] = max(unique) if unique else None
    return out


def stop(leader: int, seen: Optional[dict[int, int]] = None, timeout_s: float = 30.0) -> dict:
    """SIGTERM the leader; after timeout_s SIGKILL whatever of its tree, or of `seen` (identities), is left.

    `seen` catches what left the tree: a child in a session of its own (this service's workers) whose
    parent has exited is no longer anybody's descendant.

    Return {"exit": how it ended, "killed": pids killed, "left": pids still alive after the kill}.
    """
    try:
        os.kill(leader, signal.SIGTERM)
    except ProcessLookupError:
        pass
    seen = seen or {}
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


def stop_started(process, seen: dict[int, int]) -> dict:
    """Stop a leader this program started (a subprocess.Popen) and its tree, what `seen` holds too; reap it.

    The tree as it is now joins `seen` first, so a child that outlives its parent is still found.
    Return stop()'s answer.
    """
    seen.update(identities(tree(process.pid)))
    answer = stop(process.pid, seen)
    process.wait()
    return answer


def _alive(leader: int, seen: dict[int, int]) -> list[int]:
    """Live processes of the tree, and of `seen` that are still the same processes (not zombies)."""
    alive = set(tree(leader))
    for pid, started in seen.items():
        found = _stat(pid)
        if found is not None and found[0] != "Z" and found[3] == started:
            alive.add(pid)
    return sorted(alive)
