"""A video through a model: its frames decoded, queued a window at a time, tracked, and answered in order.

`start_video` does everything that can refuse the request before its answer starts: it admits the request to
the model (which starts loading if it must), opens and checks the video (app/vision/video.py: every limit,
a truncated file), and waits for the model to be ready. The VideoRun it returns is then streamed by the
front door, as NDJSON records (`records`) or as an annotated MP4 (`mp4`).

Inside one video at most `video_frames_in_flight` frames are in the model's queue or its calls at once, so
a video shares the model with other clients instead of filling its queue: their images wait behind at most
that many frames. Frames go to the batching threads (never run in the request's own thread), so that a
video's consecutive frames share model calls. A full queue mid-video is backpressure, not an error: the
video waits for its own frames to come back, or, with none out, for room, up to request_deadline_s; past
that the stream ends with an error line (`overloaded`). A frame that fails (the model, a decoder error, a
limit the header hid) ends the stream with an error line too; the frames answered before it stand.

A client that goes away (the request's Cancellation, app/cancellation.py, cancelled by the front door) stops the
run between frames and while it waits: decoding stops, its frames still queued leave the queue at once (the queue
drops them, as it drops any gone client's images), and `close` gives the video, its decoder threads and the model
back. Called in one request thread; a VideoRun is not shared.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Optional

from ..cancellation import Cancellation
from ..errors import AnswerCut, DetectError, InferenceFailed, Overloaded, RequestError
from ..inference.detections import MAX_DETECTIONS_LIMIT, to_detections
from ..vision.annotate import draw_detections
from ..vision.tracking import LOW, Tracker
from ..vision.video import Frame, VideoFile, VideoLimits, VideoWriter, open_video
from .plane import served_version

log = logging.getLogger(__name__)

WAIT_STEP_S = 0.05  # how often a waiting video looks at its client


@dataclass(frozen=True)
class VideoOptions:
    """What one video request asks for."""

    threshold: float
    max_detections: int
    fps: Optional[float] = None  # frames per second to sample; None: every frame, up to max_video_fps
    annotated: bool = False  # an MP4 with the boxes drawn, rather than NDJSON


def start_video(plane, model, source: BinaryIO, options: VideoOptions, cancellation: Cancellation) -> "VideoRun":
    """Admit a video request to `model`, open and check the video in `source`, wait for the model; return the run.

    Raise the request's errors (the limits, a bad or truncated video, the model unavailable) before any answer
    begins. The caller must `close` the run it gets, streamed or not.
    """
    settings = plane.settings
    limits = VideoLimits(settings.max_image_pixels, settings.max_video_s, settings.max_video_frames)
    model.admit()
    try:
        video = open_video(source, limits, settings.video_decoder_threads)
        try:
            model.wait_ready(plane.deadline())
        except BaseException:
            video.close()
            raise
    except BaseException:
        model.release()
        raise
    return VideoRun(plane, model, video, options, cancellation)


class VideoRun:
    """One admitted video: stream it with `records` or `mp4`, then `close` it (idempotent)."""

    def __init__(self, plane, model, video: VideoFile, options: VideoOptions, cancellation: Cancellation):
        self._plane = plane
        self._model = model
        self._video = video
        self._options = options
        self._cancellation = cancellation
        settings = plane.settings
        info = video.info
        fps = options.fps
        if fps is None and info.fps > settings.max_video_fps:
            fps = settings.max_video_fps
        self._fps = fps  # None: every frame
        self.sampled_fps = round(min(fps, info.fps) if fps is not None and info.fps else (fps or info.fps), 3)
        self._window = settings.video_frames_in_flight
        self._pending: deque = deque()  # (frame, queued image) in the video's order
        self._started = time.perf_counter()
        self._frames = 0  # frames answered
        self._tracker: Optional[Tracker] = None
        self._outcome = "error"
        self._closed = False

    @property
    def version(self) -> Optional[str]:
        return served_version(self._model)

    def header(self) -> dict:
        """The first record: the model and the video as it was found, and the rate it is sampled at."""
        info = self._video.info
        return {"video": {"model": {"name": self._model.name, "version": self.version}, "container": info.container,
                          "codec": info.codec, "width": info.width, "height": info.height, "fps": info.fps,
                          "duration_s": info.duration_s, "frames": info.frames, "sampled_fps": self.sampled_fps}}

    def records(self) -> Iterator[dict]:
        """The NDJSON answer: the header, one record per sampled frame, then the end record, or an error record."""
        try:
            first = True
            for frame, detections, tracks in self._tracked():
                if first:
                    yield self.header()  # after the first frame is decoded: its size is the displayed one
                    first = False
                yield {"frame": frame.index, "time_s": frame.time_s,
                       "detections": [{**d.to_json(), "track_id": t} for d, t in zip(detections, tracks)]}
            if first:
                yield self.header()
            yield {"end": {"frames": self._frames, "tracks": self._tracker.tracks_started if self._tracker else 0,
                           "timing_ms": {"total": round((time.perf_counter() - self._started) * 1000, 2)}}}
            self._outcome = "complete"
        except _ClientGone:
            return
        except Exception as exc:
            if self._cancellation.cancelled:  # its body closed under the demuxer, its frames dropped: nobody reads on
                return
            error = _as_request_error(exc, self._model.name)
            yield {"error": {"code": error.code, "message": error.message}, "frames": self._frames}

    def mp4(self) -> Iterator[bytes]:
        """The annotated MP4 answer, in fragments as the frames come back; an error mid-video raises (the front
        door then cuts the answer short, so the client sees it incomplete)."""
        writer: Optional[VideoWriter] = None
        try:
            for frame, detections, tracks in self._tracked():
                picture = frame.picture()
                draw_detections(picture, detections, picture.width / frame.width, tracks)
                if writer is None:
                    writer = VideoWriter(picture.width, picture.height, self.sampled_fps)
                chunk = writer.add(picture, frame.time_s)
                if chunk:
                    yield chunk
            if writer is not None:
                yield writer.finish()
            self._outcome = "complete"
        except _ClientGone:
            return
        except Exception as exc:
            if self._cancellation.cancelled:
                return
            error = _as_request_error(exc, self._model.name)
            log.warning("an annotated video on model %s ends early, after %d frames: %s", self._model.name,
                        self._frames, error.message)
            raise AnswerCut(error.message) from None
        finally:
            if writer is not None:
                writer.close()

    def _tracked(self) -> Iterator[tuple[Frame, list, list]]:
        """Each sampled frame in order, with its detections to answer and their track ids."""
        options = self._options
        self._tracker = Tracker(high=options.threshold, fps=self.sampled_fps or 30.0)
        low = min(LOW, options.threshold)
        labels = self._model.labels
        for frame, outputs in self._run_frames():
            found = to_detections(outputs, frame.width, frame.height, labels, low, MAX_DETECTIONS_LIMIT)
            tracked = self._tracker.update(
                [(d.box.x_min, d.box.y_min, d.box.x_max, d.box.y_max) for d in found],
                [d.score for d in found], [d.class_id for d in found])[:options.max_detections]
            self._frames += 1
            yield frame, [found[t.index] for t in tracked], [t.track_id for t in tracked]

    def _run_frames(self) -> Iterator[tuple[Frame, object]]:
        """Decode, queue (a window at a time) and yield each sampled frame with the model's outputs, in order."""
        model = self._model
        settings = self._plane.settings
        size = _sizer(model.working_size() if settings.decode_at_model_size else None)
        counter = self._plane.metrics.video_frames.labels(model=model.name)
        for frame in self._video.frames(self._fps, size):
            give_up = time.monotonic() + settings.request_deadline_s
            while True:
                self._check_gone()
                try:
                    queued = model.queue.submit([frame.pixels], time.monotonic() + settings.request_deadline_s,
                                                self._cancellation, run_here=False)[0]
                    break
                except Overloaded:  # backpressure: give back what is ours first, else wait for room
                    if self._pending:
                        yield self._answer()
                    elif time.monotonic() > give_up:
                        raise
                    else:
                        time.sleep(WAIT_STEP_S)
            counter.inc()
            self._pending.append((frame, queued))
            while self._pending and (len(self._pending) >= self._window or self._pending[0][1].done()):
                yield self._answer()
        while self._pending:
            yield self._answer()

    def _answer(self) -> tuple[Frame, object]:
        """Wait for the oldest frame out, looking at the client while it waits; return it with its outputs."""
        frame, queued = self._pending[0]
        while True:
            self._check_gone()
            try:
                outputs = queued.result(timeout=WAIT_STEP_S)
                break
            except FutureTimeout:
                continue
            except DetectError:
                raise
            except Exception as exc:
                log.exception("a frame of a video failed on model %s", self._model.name)
                raise InferenceFailed(f"the model failed on frame {frame.index}: {type(exc).__name__}") from None
        self._pending.popleft()
        return frame, outputs

    def _check_gone(self) -> None:
        if self._cancellation.cancelled:
            raise _ClientGone()

    def close(self) -> None:
        """Cancel the frames still queued, close the video (its decoder threads end), give the model back, and
        count the video; idempotent. Called in the request's thread when the answer ends, however it ends."""
        if self._closed:
            return
        self._closed = True
        for _, queued in self._pending:
            queued.cancel()
        self._pending.clear()
        self._video.close()
        self._model.release()
        outcome = "gone" if self._cancellation.cancelled and self._outcome != "complete" else self._outcome
        metrics = self._plane.metrics
        metrics.videos.labels(model=self._model.name, outcome=outcome).inc()
        metrics.statistics.observe_request(self._model.name, self._frames, {}, outcome == "complete")
        log.info("video on model %s: %d frames answered, %s, in %.1f s", self._model.name, self._frames, outcome,
                 time.perf_counter() - self._started)


class _ClientGone(Exception):
    """The client went away: the run stops; nothing more is sent."""


def _as_request_error(exc: Exception, model: str) -> RequestError:
    """The error a stream ends with: the request's own, or InferenceFailed (logged) for anything else."""
    if isinstance(exc, RequestError):
        return exc
    if not isinstance(exc, DetectError):
        log.error("a video on model %s failed", model, exc_info=exc)
    return InferenceFailed(f"the video failed: {type(exc).__name__}")


def _sizer(working_size):
    """The size a frame of a given displayed size is decoded at: the model's working size, as images are."""
    if working_size is None:
        return lambda width, height: (width, height)
    if working_size.scale_step:
        return working_size.target_size

    def reduced(width: int, height: int) -> tuple[int, int]:
        k = working_size.reduction(width, height)
        return -(-width // k), -(-height // k)

    return reduced
