"""What one hand-off between two processes costs here, hot and after the CPUs have idled.

A parent and a forked child exchange a model call's messages over the workers' own Channel (app/models/
channel.py): the parent sends a `run` header, the child answers with a detector's four output arrays. It
reports the median one-way times (parent send -> child has it; child answers -> parent has it, on the
shared monotonic clock) back to back, then with a pause before each call, as a lone client's requests
meet the server: between them the virtual CPUs halt, and waking one costs far more than the copy.

    .venv/bin/python -m tools.handoff [--calls 400] [--idle-ms 0,1,10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from app.models.channel import Channel

OUTPUTS = {"detection_boxes": np.zeros((1, 100, 4), np.float32), "detection_classes": np.zeros((1, 100), np.float32),
           "detection_scores": np.zeros((1, 100), np.float32), "num_detections": np.zeros((1,), np.float32)}


def answer_calls(channel: Channel) -> None:
    """The child: answer every call at once, with its marks, until the parent closes the channel."""
    while True:
        try:
            channel.receive()
        except EOFError:
            os._exit(0)
        received = time.monotonic()
        channel.send({"errors": [None], "received": received, "answered": time.monotonic()}, OUTPUTS)


def measure(channel: Channel, calls: int, idle_s: float) -> dict:
    send, back = [], []
    for i in range(calls + 20):
        if idle_s:
            time.sleep(idle_s)
        sent = time.monotonic()
        channel.send({"op": "run", "shape": [1, 320, 320, 3]})
        header, _, _ = channel.receive()
        read = time.monotonic()
        if i >= 20:  # the first calls warm the path
            send.append(header["received"] - sent)
            back.append(read - header["answered"])
    return {"idle_ms": idle_s * 1000, "send_us": round(statistics.median(send) * 1e6, 1),
            "return_us": round(statistics.median(back) * 1e6, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.handoff", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--idle-ms", default="0,1,10", help="pauses before each call to try, comma-separated (ms)")
    args = parser.parse_args()
    mine, theirs = Channel.pair()
    child = os.fork()
    if child == 0:  # (closing `mine` here would shut the socket down for the parent too)
        answer_calls(Channel(theirs))
    theirs.close()
    try:
        print(f"{'idle before each call':>22} {'send (us)':>10} {'return (us)':>12}   load average {os.getloadavg()[0]:.2f}")
        for idle in (float(x) for x in args.idle_ms.split(",")):
            row = measure(mine, args.calls, idle / 1000)
            print(f"{row['idle_ms']:>19.1f} ms {row['send_us']:>10} {row['return_us']:>12}")
    finally:
        mine.close()
        os.waitpid(child, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
