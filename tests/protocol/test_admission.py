"""The one admission rule (app/protocol/admission.py), in-process: each kind of call within its cap, nothing while
the server drains, no inference call while its model's queue is full, and a held call ended once idle, never while
busy. Both doors use this object; tests/protocol/test_held_calls.py drives it through real servers."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

import pytest

from app.errors import NotReady, Overloaded
from app.protocol.admission import (
    END_GRACE_S, HELD, INFERENCE, REFLECTION, REFLECTION_CAP, SEND_DEADLINE_S, STREAM, VIDEO, WATCH, Admission,
    caps_from,
)
from app.settings import Settings


@dataclass
class Draining:
    draining: bool = False


class FullQueue:
    def refusal(self):
        return Overloaded("the inference queue is full (1 images waiting, at most 1); retry shortly")


class Model:
    def __init__(self, full: bool = False):
        self.queue = FullQueue() if full else type("Roomy", (), {"refusal": lambda self: None})()


SETTINGS = replace(Settings(), http_threads=3, max_streams=2, max_watches=4, max_video_streams=2, idle_timeout_s=1.0)


def test_the_caps_come_from_the_settings_and_every_held_kind_has_one():
    caps = caps_from(SETTINGS)
    assert caps == {INFERENCE: 3, STREAM: 2, WATCH: 4, REFLECTION: REFLECTION_CAP, VIDEO: 2}
    assert set(HELD) <= set(caps)


@pytest.mark.parametrize("kind, setting", [(INFERENCE, "http_threads"), (STREAM, "max_streams"),
                                           (WATCH, "max_watches"), (REFLECTION, str(REFLECTION_CAP)),
                                           (VIDEO, "max_video_streams")])
def test_each_kind_is_admitted_up_to_its_cap_and_the_next_is_refused_naming_it(kind, setting):
    admission = Admission("grpc", SETTINGS)
    tickets = [admission.enter(kind) for _ in range(admission.caps[kind])]
    with pytest.raises(Overloaded, match=setting):
        admission.enter(kind)
    others = [k for k in admission.caps if k != kind]
    for other in others:  # one kind at its cap takes nothing from another
        admission.leave(admission.enter(other))
    tickets[0].leave()
    tickets[0].leave()  # a second leave counts nothing out
    assert admission.open_calls(kind) == admission.caps[kind] - 1
    admission.leave(admission.enter(kind))


def test_nothing_is_admitted_while_the_server_drains():
    lifecycle = Draining()
    admission = Admission("http", SETTINGS, lifecycle)
    held = admission.enter(STREAM)
    lifecycle.draining = True
    for kind in admission.caps:
        with pytest.raises(NotReady, match="shutting down"):
            admission.enter(kind)
    held.leave()
    assert all(admission.open_calls(kind) == 0 for kind in admission.caps)


def test_an_inference_call_to_a_model_whose_queue_is_full_is_refused_and_not_counted():
    admission = Admission("http", SETTINGS)
    with pytest.raises(Overloaded, match="queue is full"):
        admission.enter(INFERENCE, Model(full=True))
    assert admission.open_calls(INFERENCE) == 0
    with admission.admit(Model()):
        assert admission.open_calls(INFERENCE) == 1
    assert admission.open_calls(INFERENCE) == 0


def test_a_held_call_is_ended_once_idle_and_never_while_busy_or_moving():
    ended: list[str] = []
    admission = Admission("grpc", SETTINGS, on_idle_end=ended.append)
    idle, busy, moving, plain = (admission.enter(kind) for kind in (STREAM, STREAM, REFLECTION, INFERENCE))
    calls = []
    for ticket in (idle, busy, moving):
        ticket.on_idle = lambda ticket=ticket: calls.append(ticket) or True
    busy.busy = 1
    start = time.monotonic()
    assert admission.end_idle(start) == 0  # nothing is idle yet
    moving.last_moved = start + 5
    assert admission.end_idle(start + 2) == 1 and calls == [idle] and ended == [STREAM]
    assert admission.end_idle(start + 3) == 0  # once only
    busy.busy = 0
    assert admission.end_idle(start + 4) == 1 and calls == [idle, busy]
    assert plain.on_idle is None  # an inference call is not held: never ended for idleness


def test_a_call_that_became_busy_as_it_was_ended_is_looked_at_again_later():
    admission = Admission("grpc", SETTINGS)
    ticket = admission.enter(STREAM)
    answers = iter([False, True])  # busy again at the first look, idle at the next
    ticket.on_idle = lambda: next(answers)
    start = time.monotonic()
    assert admission.end_idle(start + 2) == 0 and ticket.ended_at is None
    assert admission.end_idle(start + 3) == 1 and ticket.ended_at is not None


def test_a_watch_is_never_idle_but_is_cut_when_its_client_stops_reading():
    """A Watch hears from the server only when a status changes: quiet is its normal state. A send to it that
    waits SEND_DEADLINE_S means its client reads nothing: the call is cut, whatever its kind."""
    admission = Admission("grpc", SETTINGS)
    watch, stream = admission.enter(WATCH), admission.enter(STREAM)
    cut = []
    for ticket in (watch, stream):
        ticket.on_idle = lambda: True
        ticket.on_cut = lambda ticket=ticket: cut.append(ticket.kind)
    stream.sending(True)
    assert admission.end_idle(time.monotonic() + SEND_DEADLINE_S / 2) == 0 and cut == []  # mid-send: not idle
    stream.sending(False)
    stream.last_moved = watch.last_moved = time.monotonic() - 3600
    assert admission.end_idle() == 1 and cut == []  # the stream ended idle, the Watch quiet an hour left alone
    stream.ended_at, stream.on_idle = None, None
    stream.sending(True)
    watch.sending(True)
    assert admission.end_idle(time.monotonic() + SEND_DEADLINE_S) == 2 and sorted(cut) == [STREAM, WATCH]
    assert admission.end_idle(time.monotonic() + 2 * SEND_DEADLINE_S) == 0  # cut once


def test_a_call_that_an_idle_end_did_not_end_is_cut_after_the_grace_and_counted_out_only_when_it_ends():
    admission = Admission("grpc", SETTINGS)
    ticket = admission.enter(STREAM)
    cut = []
    ticket.on_idle = lambda: True  # ended gracefully... but its thread is stuck, and it does not end
    ticket.on_cut = lambda: cut.append(True)
    start = time.monotonic()
    assert admission.end_idle(start + 2) == 1
    assert admission.end_idle(start + 2 + END_GRACE_S / 2) == 0 and cut == []
    assert admission.end_idle(start + 2 + END_GRACE_S) == 1 and cut == [True]
    assert admission.open_calls(STREAM) == 1  # still held: only the call's own end counts it out
    ticket.leave()
    assert admission.open_calls(STREAM) == 0


def test_the_watchdog_thread_ends_an_idle_call_by_itself():
    admission = Admission("grpc", replace(SETTINGS, idle_timeout_s=1.0))
    ended = threading.Event()
    ticket = admission.enter(STREAM)
    ticket.on_idle = lambda: ended.set() or True
    try:
        assert ended.wait(5.0), "the idle Watch was not ended within 5 s of a 1 s idle timeout"
    finally:
        admission.stop()


def test_the_reflection_cap_is_the_one_the_docs_and_the_attack_tests_name():
    import test_held_calls

    assert test_held_calls.REFLECTION_CAP == REFLECTION_CAP == 8
