"""Videos made for the tests with PyAV: the blob model's coloured squares moving, in any container, cut or broken."""

from __future__ import annotations

import io
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from blob_model import blob_image

CODECS = {"mp4": "libx264", "mov": "libx264", "webm": "libvpx-vp9", "matroska": "mjpeg"}


def red_and_green(index: int, width: int = 160, height: int = 120) -> np.ndarray:
    """A red square gliding right (class 1) and a green one still (class 2), on grey."""
    x = 4 + 2 * index % max(1, width - 40)
    return blob_image(width, height, {1: (x, 20, x + 30, 50), 2: (100, 70, 140, 110)})


def make_video(frames: int = 30, fps: float = 30, container: str = "mp4", size: tuple[int, int] = (160, 120),
               draw: Callable[[int, int, int], np.ndarray] = red_and_green, faststart: bool = True,
               rotation: Optional[int] = None, audio: bool = False) -> bytes:
    """Encode `frames` frames of `draw(index, width, height)` as a video file; return its bytes."""
    import av

    options = {"movflags": "+faststart"} if faststart and container in ("mp4", "mov") else {}
    codec = CODECS[container]
    with tempfile.TemporaryDirectory() as scratch:  # faststart rewrites the file by its name: not in memory
        path = Path(scratch) / f"video.{container}"
        _encode(path, frames, fps, container, size, draw, options, codec, rotation, audio)
        return path.read_bytes()


def _encode(path, frames, fps, container, size, draw, options, codec, rotation, audio) -> None:
    import av

    with av.open(str(path), "w", format=container, options=options) as out:
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = size
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "12", "preset": "ultrafast"}
        if rotation is not None:
            stream.set_display_rotation(rotation)
        sound = out.add_stream("aac", rate=44100) if audio else None
        for index in range(frames):
            pixels = draw(index, *size)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if sound is not None:
            for packet in _silence(sound):
                out.mux(packet)


def audio_only() -> bytes:
    """An MP4 with one AAC stream and no video."""
    import av

    out_file = io.BytesIO()
    with av.open(out_file, "w", format="mp4") as out:
        sound = out.add_stream("aac", rate=44100)
        for packet in _silence(sound):
            out.mux(packet)
    return out_file.getvalue()


def _silence(stream):
    import av

    frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
    frame.sample_rate = 44100
    yield from stream.encode(frame)
    yield from stream.encode()


def break_frame(video: bytes, index: int) -> bytes:
    """Make frame `index` of an H.264 MP4 undecodable: its first NAL unit's length is made longer than its packet."""
    import av

    with av.open(io.BytesIO(video)) as container:
        positions = [p.pos for p in container.demux(video=0) if p.size]
    broken = bytearray(video)
    broken[positions[index]:positions[index] + 4] = b"\x7f\xff\xff\xff"
    return bytes(broken)


def padded(video: bytes, size: int) -> bytes:
    """The video followed by a `free` box of `size` bytes that every demuxer skips: a body as big as needed."""
    return video + (size + 8).to_bytes(4, "big") + b"free" + bytes(size)
