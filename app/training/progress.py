"""A one-line console progress bar: redrawn in place on a terminal, a plain line now and then in a log file."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class ProgressBar:
    """Show `done/total`, a bar, an ETA and caller-given fields such as loss and images/s; not thread-safe."""

    def __init__(self, total: int, label: str, start: int = 0, stream: Optional[TextIO] = None,
                 log_every_s: float = 15.0, width: int = 24):
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every_s = log_every_s
        self._start_done = start
        self._started = time.monotonic()
        self._last_line = -float("inf")

    def update(self, done: int, **fields) -> None:
        """Redraw for `done` items finished; `fields` are shown as name value, floats to 4 digits."""
        now = time.monotonic()
        last = done >= self.total
        if not (self.interactive or last or now - self._last_line >= self.log_every_s):
            return
        self._last_line = now
        line = self._format(done, now, fields)
        if self.interactive:
            self.stream.write("\r" + line + ("\n" if last else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _format(self, done: int, now: float, fields: dict) -> str:
        share = min(done / self.total, 1.0)
        filled = int(round(share * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = now - self._started
        rate = (done - self._start_done) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        shown = " ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
        return (f"{self.label} {done}/{self.total} [{bar}] {shown} "
                f"elapsed {_clock(elapsed)} eta {_clock(eta)}").rstrip()


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _clock(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "--:--"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
