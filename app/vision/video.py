"""Open, check and decode a video file with PyAV (FFmpeg's libraries, the `video` extra), and encode one.

A body is taken only as MP4, MOV, Matroska or WebM, known by its first bytes, and opened with that
demuxer named outright: FFmpeg never guesses a format, so none of its playlist or concatenating
demuxers (which open other files and URLs) can be reached, and any other file the demuxer asks to
open is refused. Only the decoders in DECODERS run.

`open_video` reads the whole file once without decoding it (demuxing is cheap: no pixel is made), and
so checks every limit before an answer starts: the frames and the duration the packets really hold
(not what the header claims), the frame size against the pixel limit, a truncated file (fewer packets
than its index names, or short of its stated duration). Then `frames` decodes it, sampled at the rate
asked, each frame converted by FFmpeg's scaler straight to the model's working size and turned
upright (a phone's rotation). Frames that break a limit anyway, or a decoder that fails halfway, raise
the request's own errors from `frames`, which the caller turns into an error line.

Called in one request thread per video; a VideoFile is not shared. Closing it (always: it is a context
manager) ends FFmpeg's decoder threads; the caller owns the source file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import BinaryIO, Callable, Iterator, Optional

import numpy as np
from PIL import Image

from ..errors import ImageTooLarge, InvalidVideo, MissingExtra, UnsupportedVideoFormat, VideoTooLarge
from ..extras import require_extra

# Demuxer by container, and the Content-Types a video body may have.
CONTAINERS = {"mp4": "mov", "mov": "mov", "matroska": "matroska", "webm": "matroska"}
VIDEO_TYPES = ("video/mp4", "video/quicktime", "video/webm", "video/x-matroska", "application/octet-stream")
DECODERS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg")
TRUNCATION_SLACK_S = 0.25  # a file whose packets end this much short of its stated duration is cut off

# Known formats that are not videos taken here: refused by name (415) rather than as noise (400).
_OTHER_FORMATS = (
    (b"RIFF", "AVI or WAV"), (b"FLV", "FLV"), (b"\x47", "MPEG-TS"), (b"\x00\x00\x01\xba", "MPEG-PS"),
    (b"OggS", "Ogg"), (b"\xff\xd8\xff", "JPEG"), (b"\x89PNG", "PNG"), (b"GIF8", "GIF"), (b"#EXTM3U", "HLS playlist"),
    (b"ffconcat", "FFmpeg concat list"), (b"%PDF", "PDF"), (b"PK\x03\x04", "ZIP"),
)
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot")


def _av():
    require_extra("video", "av", "video (POST /detect/video)")
    import av

    return av


def video_available() -> bool:
    """Whether PyAV (the `video` extra) is installed."""
    try:
        _av()
    except MissingExtra:
        return False
    return True


@dataclass(frozen=True)
class VideoLimits:
    """What one video may hold."""

    max_pixels: int  # a frame's width x height
    max_seconds: float  # from its first frame to its last
    max_frames: int  # frames in the file, sampled or not: each is decoded


@dataclass(frozen=True)
class VideoInfo:
    """What the demuxing pass found: the video as it is, before sampling."""

    container: str  # mp4, mov, matroska or webm
    codec: str
    width: int  # as displayed once a frame is decoded (a rotation of 90 or 270 degrees swaps them); as coded before
    height: int
    fps: float  # the average frame rate (frames / duration where the file does not say)
    duration_s: float
    frames: int  # packets of the video stream, each a frame


@dataclass
class Frame:
    """One sampled frame: where it is in the video, the model's pixels, and the decoded frame for drawing."""

    index: int  # in the video's frames, from 0, in presentation order
    time_s: float  # from the first frame
    pixels: np.ndarray  # RGB uint8, upright, at the model's working size
    width: int  # as displayed
    height: int
    _frame: object = None  # PyAV's VideoFrame
    _rotation: int = 0

    def picture(self) -> Image.Image:
        """The frame upright at full size, as a Pillow image to draw on."""
        return _upright(self._frame.to_image(), self._rotation)


def sniff(head: bytes) -> str:
    """Name the container of a body from its first bytes (at least 12): mp4, mov, matroska or webm.

    Raise UnsupportedVideoFormat for a known format that is not taken, InvalidVideo for anything else.
    """
    if head.startswith(b"\x1a\x45\xdf\xa3"):  # EBML
        return "webm" if b"webm" in head[:64] else "matroska"
    if len(head) >= 12 and head[4:8] in _MP4_BOXES:
        return "mov" if head[4:12] == b"ftypqt  " or head[4:8] in (b"wide", b"pnot") else "mp4"
    for magic, name in _OTHER_FORMATS:
        if head.startswith(magic):
            raise UnsupportedVideoFormat(f"{name} is not taken; send an MP4, MOV, MKV or WebM video")
    if not head:
        raise InvalidVideo("the body is empty; send an MP4, MOV, MKV or WebM video")
    raise InvalidVideo("the body is not an MP4, MOV, MKV or WebM video")


class VideoFile:
    """A video opened and checked (`open_video`); decode it with `frames`; close it (a context manager)."""

    def __init__(self, source: BinaryIO, container: str, limits: VideoLimits, decoder_threads: int):
        self._source = source
        self._container_name = container
        self._limits = limits
        self._threads = decoder_threads
        self._container = None
        self.info: Optional[VideoInfo] = None

    def __enter__(self) -> "VideoFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the demuxer and its decoder (and FFmpeg's threads with it); the source stays open."""
        container, self._container = self._container, None
        if container is not None:
            container.close()

    def _open(self):
        av = _av()
        self.close()
        self._source.seek(0)
        try:
            container = av.open(self._source, format=CONTAINERS[self._container_name], io_open=_refuse_open,
                                metadata_errors="ignore", options={"enable_drefs": "0"})
        except av.FFmpegError as exc:
            raise InvalidVideo(f"the {self._container_name.upper()} file cannot be read (truncated or not a "
                               f"video): {_why(exc)}") from None
        self._container = container
        if not container.streams.video:
            raise InvalidVideo(f"the {self._container_name.upper()} file has no video stream")
        stream = container.streams.video[0]
        codec = stream.codec_context.name
        if codec not in DECODERS:
            raise UnsupportedVideoFormat(f"the video is {codec}; the decoders taken are {', '.join(DECODERS)}")
        return av, container, stream

    def probe(self) -> VideoInfo:
        """Read every packet of the video stream, without decoding; check the limits; return what it holds."""
        av, container, stream = self._open()
        width, height = stream.codec_context.width, stream.codec_context.height
        self._check_pixels(width, height, "the video's frames are")
        base = stream.time_base
        limits = self._limits
        count, first, last, last_duration = 0, None, None, 0
        try:
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue  # the flush packet at the end
                if packet.is_corrupt:
                    raise InvalidVideo(f"the video is corrupt or truncated at frame {count}")
                count += 1
                if count > limits.max_frames:
                    raise VideoTooLarge(f"the video has more than {limits.max_frames} frames, over the limit "
                                        "(max_video_frames)")
                if packet.pts is not None:
                    first = packet.pts if first is None else min(first, packet.pts)
                    if last is None or packet.pts >= last:
                        last, last_duration = packet.pts, packet.duration or 0
                    if (last - first) * base > limits.max_seconds:
                        raise VideoTooLarge(f"the video is longer than {limits.max_seconds:g} s, over the limit "
                                            "(max_video_s)")
        except av.FFmpegError as exc:
            raise InvalidVideo(f"the video cannot be read after frame {count}: {_why(exc)}") from None
        if count == 0:
            raise InvalidVideo("the video stream holds no frames")
        span = float((last - first + last_duration) * base) if first is not None else 0.0
        self._check_truncation(stream, count, span)
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else (count / span if span > 0 else 0.0)
        self.info = VideoInfo(container=self._container_name, codec=stream.codec_context.name, width=width,
                              height=height, fps=round(fps, 3), duration_s=round(span, 3), frames=count)
        return self.info

    def _check_truncation(self, stream, count: int, span: float) -> None:
        if stream.frames and count < stream.frames:
            raise InvalidVideo(f"the video is truncated: its index names {stream.frames} frames and the file holds "
                               f"{count}")
        stated = float(stream.duration * stream.time_base) if stream.duration else None
        if stated is None and len(self._container.streams) == 1 and self._container.duration:
            stated = self._container.duration / 1_000_000
        if stated is not None and span + TRUNCATION_SLACK_S < stated:
            raise InvalidVideo(f"the video is truncated: it says it lasts {stated:.2f} s and its frames end at "
                               f"{span:.2f} s")

    def frames(self, fps: Optional[float], size: Callable[[int, int], tuple[int, int]]) -> Iterator[Frame]:
        """Decode the video and yield its frames sampled at `fps` (None: every frame), each at `size(width,
        height)` of its displayed size. Raise VideoTooLarge, ImageTooLarge or InvalidVideo where a frame breaks
        a limit or the decoder fails."""
        av, container, stream = self._open()
        stream.thread_type = "AUTO"
        stream.thread_count = self._threads
        limits = self._limits
        decoded, first, taken_slot = 0, None, -1
        try:
            for frame in container.decode(stream):
                decoded += 1
                if decoded > limits.max_frames:
                    raise VideoTooLarge(f"the video has more than {limits.max_frames} frames, over the limit "
                                        "(max_video_frames)")
                self._check_pixels(frame.width, frame.height, f"frame {decoded - 1} is")
                now = frame.time if frame.time is not None else (decoded - 1) / (self.info.fps or 30.0)
                first = now if first is None else first
                time_s = now - first
                if time_s > limits.max_seconds:
                    raise VideoTooLarge(f"the video is longer than {limits.max_seconds:g} s, over the limit "
                                        "(max_video_s)")
                if fps is not None:
                    slot = math.floor(time_s * fps + 1e-6)
                    if slot <= taken_slot:
                        continue
                    taken_slot = slot
                yield self._sampled(frame, decoded - 1, time_s, size)
        except av.FFmpegError as exc:
            raise InvalidVideo(f"the decoder failed at frame {decoded}: {_why(exc)}") from None

    def _sampled(self, frame, index: int, time_s: float, size) -> Frame:
        rotation = _frame_rotation(frame)
        turned = rotation in (90, 270)
        width, height = (frame.height, frame.width) if turned else (frame.width, frame.height)
        target_w, target_h = size(width, height)
        if turned:
            target_w, target_h = target_h, target_w
        pixels = frame.to_ndarray(width=target_w, height=target_h, format="rgb24", interpolation="AREA")
        if rotation:
            pixels = np.ascontiguousarray(np.rot90(pixels, k=-(rotation // 90)))  # rot90 turns anticlockwise
        if turned and self.info is not None and self.info.width != width:
            self.info = replace(self.info, width=width, height=height)
        return Frame(index=index, time_s=round(time_s, 4), pixels=pixels, width=width, height=height, _frame=frame,
                     _rotation=rotation)

    def _check_pixels(self, width: int, height: int, what: str) -> None:
        if width <= 0 or height <= 0:
            raise InvalidVideo(f"{what} {width}x{height}: they have no pixels")
        if width * height > self._limits.max_pixels:
            raise ImageTooLarge(f"{what} {width}x{height} = {width * height} pixels, over the limit of "
                                f"{self._limits.max_pixels} (max_image_pixels)")


def open_video(source: BinaryIO, limits: VideoLimits, decoder_threads: int = 2) -> VideoFile:
    """Recognise, open and check the video in `source` (a seekable binary file); return it, probed.

    Raise InvalidVideo, UnsupportedVideoFormat, VideoTooLarge or ImageTooLarge; MissingExtra without PyAV.
    """
    source.seek(0)
    container = sniff(source.read(64))
    video = VideoFile(source, container, limits, decoder_threads)
    try:
        video.probe()
    except BaseException:
        video.close()
        raise
    return video


class VideoWriter:
    """Encode frames as a fragmented MP4 (H.264), handing out its bytes as they are made.

    Fragmented (an empty moov first, then a fragment per key frame, one a second), so that the answer can
    start before the video ends and a browser plays it as it comes. libx264 where PyAV's FFmpeg has it,
    else FFmpeg's own MPEG-4 Part 2 (which browsers do not play).
    """

    def __init__(self, width: int, height: int, fps: float):
        av = _av()
        self._chunks: list[bytes] = []
        self._output = av.open(_Sink(self._chunks), "w", format="mp4",
                               options={"movflags": "frag_keyframe+empty_moov+default_base_moof"})
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        rate = Fraction(fps).limit_denominator(1001) if fps > 0 else Fraction(30)
        self._stream = self._output.add_stream(codec, rate=rate)
        self._stream.width, self._stream.height = width - width % 2, height - height % 2  # 4:2:0 needs even sides
        self._stream.pix_fmt = "yuv420p"
        self._stream.codec_context.time_base = Fraction(1, 1000)
        self._stream.thread_count = 1
        if codec == "libx264":
            self._stream.options = {"preset": "veryfast", "tune": "zerolatency", "crf": "23",
                                    "g": str(max(1, round(float(rate))))}
        self._av = av
        self._last_pts = -1

    def add(self, picture: Image.Image, time_s: float) -> bytes:
        """Encode one picture shown at `time_s`; return the bytes ready to send (often none)."""
        frame = self._av.VideoFrame.from_image(picture.convert("RGB"))
        frame = frame.reformat(width=self._stream.width, height=self._stream.height, format="yuv420p")
        pts = max(round(time_s * 1000), self._last_pts + 1)
        self._last_pts = pts
        frame.pts, frame.time_base = pts, Fraction(1, 1000)
        for packet in self._stream.encode(frame):
            self._output.mux(packet)
        return self._take()

    def finish(self) -> bytes:
        """Flush the encoder and close the file; return the last bytes."""
        for packet in self._stream.encode():
            self._output.mux(packet)
        self._output.close()
        return self._take()

    def close(self) -> None:
        """Close without finishing (the client went away, or an error); idempotent."""
        output, self._output = self._output, None
        if output is not None:
            try:
                output.close()
            except Exception:  # an unfinished file; nothing more will be sent
                pass

    def _take(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data


class _Sink:
    """A write-only file for the muxer: chunks kept until taken. Fragmented MP4 never seeks back."""

    def __init__(self, chunks: list[bytes]):
        self._chunks = chunks
        self._written = 0

    def write(self, data) -> int:
        self._chunks.append(bytes(data))
        self._written += len(data)
        return len(data)

    def tell(self) -> int:
        return self._written

    def seekable(self) -> bool:
        return False


def _refuse_open(url: str, flags: int, options: dict):
    """Refuse every file a demuxer asks to open beside the body (external references, playlists)."""
    raise InvalidVideo("the video refers to other files, which are never opened")


def _why(exc) -> str:
    """FFmpeg's own words for a failure, without the file name PyAV puts in."""
    text = str(getattr(exc, "strerror", "") or exc)
    log = getattr(exc, "log", None)
    if log and len(log) >= 3 and log[2]:
        text += f" ({str(log[2]).strip()[:200]})"
    return text[:300]


def _frame_rotation(frame) -> int:
    """The clockwise turn (0, 90, 180, 270) that shows a frame upright: its display matrix's rotation is
    anticlockwise, as FFmpeg's own autorotation reads it."""
    try:
        return _quarter(-frame.rotation)
    except Exception:  # no display matrix, or an older PyAV
        return 0


def _quarter(degrees) -> int:
    if degrees is None:
        return 0
    try:
        return int(round(float(degrees) / 90.0)) % 4 * 90
    except (TypeError, ValueError):
        return 0


def _upright(image: Image.Image, rotation: int) -> Image.Image:
    turn = {90: Image.Transpose.ROTATE_270, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_90}
    return image.transpose(turn[rotation]) if rotation in turn else image
