"""What the fleet and the model workers share about supervising child processes.

A child that exits unexpectedly is restarted after a backoff that doubles with each recent exit
(`backoff_s`, 2 x, 4 x, ... at most 60 s), and given up after `max_failures` exits within
`failure_window_s`, as gunicorn's arbiter and systemd's StartLimitBurst do. A child that exits with
BOOT_ERROR could not start as configured (a bad setting, model or memory policy): a restart would
fail the same way, so it is given up at once.
"""

from __future__ import annotations

import signal
import subprocess
from collections import deque
from dataclasses import dataclass
from typing import Optional

BOOT_ERROR = 2  # exit status of a process that cannot start as configured
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class RestartRule:
    """When to restart a child that exited, and when to give it up."""

    max_failures: int = 5  # exits within failure_window_s after which it is given up
    failure_window_s: float = 300.0
    backoff_s: float = 1.0  # first restart delay; doubled for each exit in the window, at most MAX_BACKOFF_S


@dataclass(frozen=True)
class Verdict:
    """What to do about one exit."""

    give_up: bool
    delay_s: float  # before the restart (0 when given up)
    failures: int  # exits within the window, this one included
    reason: str  # for the log and for status pages: why it was given up, or when it restarts


class ExitHistory:
    """The recent exits of one supervised child, and the verdict on each new one; not thread-safe."""

    def __init__(self, rule: RestartRule):
        self.rule = rule
        self._exits: deque[float] = deque()

    def record(self, now: float, boot_error: bool = False) -> Verdict:
        """Record an exit at `now` (time.monotonic()) and return what to do about it."""
        window = self.rule.failure_window_s
        self._exits.append(now)
        while self._exits and now - self._exits[0] > window:
            self._exits.popleft()
        failures = len(self._exits)
        if boot_error:
            return Verdict(True, 0.0, failures, "a boot error (a bad setting, model or memory policy)")
        if failures >= self.rule.max_failures:
            return Verdict(True, 0.0, failures, f"{failures} exits in {window:g} s")
        delay = min(MAX_BACKOFF_S, self.rule.backoff_s * 2 ** (failures - 1))
        return Verdict(False, delay, failures,
                       f"restarting in {delay:.1f} s (exit {failures} of {self.rule.max_failures} allowed "
                       f"in {window:g} s)")

    def clear(self) -> None:
        """Forget past exits (an operator asked for a fresh start)."""
        self._exits.clear()

    def __len__(self) -> int:
        """Exits within the window, as of the last one recorded."""
        return len(self._exits)


def describe_exit(code: int) -> str:
    """Say how a process ended, from its Popen return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def stop_process(process: subprocess.Popen, timeout_s: float) -> tuple[int, bool]:
    """SIGTERM a process, wait up to `timeout_s`, then SIGKILL it; return (exit code, stopped in time)."""
    if process.poll() is None:
        try:
            process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        return process.wait(timeout_s), True
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(), False


def kill_process(process: subprocess.Popen) -> Optional[int]:
    """SIGKILL a process that must end now, and reap it."""
    if process.poll() is None:
        try:
            process.kill()
        except ProcessLookupError:
            pass
    return process.wait()
