"""Draw detections on a picture (boxes, labels, scores, track ids) and encode it as JPEG or PNG.

Pillow's own drawing and its scalable default font (Aileron, embedded in Pillow: no font file is added).
Each class has one colour, the same in every answer, every video and the page (page.js's CLASS_COLOURS
is this palette; tests/test_annotate.py holds them equal). Lines and letters grow with the picture, so
a label reads the same on a thumbnail and a 4K frame. Called in request threads; thread-safe (each call
draws on its own picture; the fonts, cached by size, are only read).
"""

from __future__ import annotations

import io
from functools import lru_cache
from typing import Optional, Sequence

from PIL import Image, ImageDraw, ImageFont

from ..inference.detections import Detection

# Twenty colours that stay apart on photos and from one another (Tableau 20's strong half, then others),
# by class id: class 1 takes the first.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
    "#393b79", "#e6550d", "#31a354", "#ad494a", "#6b6ecf", "#8c6d31", "#ce6dbd", "#3182bd", "#a55194", "#637939",
)
JPEG_QUALITY = 85
PICTURE_TYPES = {"jpeg": "image/jpeg", "png": "image/png"}


def colour_of(class_id: int) -> tuple[int, int, int]:
    """The colour of a class, the same in every answer: PALETTE by class id (ids from 1), round again past 20."""
    code = PALETTE[(int(class_id) - 1) % len(PALETTE)]
    return int(code[1:3], 16), int(code[3:5], 16), int(code[5:7], 16)


@lru_cache(maxsize=32)
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def draw_detections(picture: Image.Image, detections: Sequence[Detection], scale: float = 1.0,
                    track_ids: Optional[Sequence[Optional[int]]] = None) -> None:
    """Draw each detection's box and its label, score (and track id) on `picture`, in place.

    Boxes are in the answer's pixels; `scale` takes them to the picture's (the picture's side over the
    image's, when the picture was made smaller). The least sure are drawn first, so the surest are on top.
    """
    if not detections:
        return
    short = min(picture.size)
    line = max(2, round(short / 240))
    size = max(11, round(short / 36))
    pad = max(1, line // 2)
    draw = ImageDraw.Draw(picture)
    order = sorted(range(len(detections)), key=lambda i: detections[i].score)
    for i in order:
        detection = detections[i]
        colour = colour_of(detection.class_id)
        b = detection.box
        x0, y0, x1, y1 = (round(v * scale) for v in (b.x_min, b.y_min, b.x_max, b.y_max))
        draw.rectangle((x0, y0, max(x0, x1 - 1), max(y0, y1 - 1)), outline=colour, width=line)
        track = track_ids[i] if track_ids is not None else None
        tag = _tag(f"{'' if track is None else f'#{track} '}{detection.label} {detection.score:.2f}", size, pad,
                   colour)
        tag_y = y0 - tag.height if y0 - tag.height >= 0 else y0  # above the box, or inside its top if no room
        tag_x = min(max(0, x0), max(0, picture.width - tag.width))
        picture.paste(tag, (tag_x, tag_y))


@lru_cache(maxsize=4096)
def _tag(text: str, size: int, pad: int, colour: tuple[int, int, int]) -> Image.Image:
    """A label's tag: its text on its class's colour. Rendering letters is most of a drawing's cost, and the same
    tags come again and again (scores have two decimals; a video's objects keep their numbers), so each is
    rendered once. Only read after it is made, so threads share it."""
    font = _font(size)
    left, top, right, bottom = font.getbbox(text)
    tag = Image.new("RGB", (right - left + 2 * pad, bottom - top + 2 * pad), colour)
    ImageDraw.Draw(tag).text((pad - left, pad - top), text, font=font, fill=_ink_on(colour))
    return tag


def _ink_on(colour: tuple[int, int, int]) -> tuple[int, int, int]:
    """Black or white, whichever reads better on `colour` (by its relative luminance)."""
    red, green, blue = colour
    return (0, 0, 0) if 0.2126 * red + 0.7152 * green + 0.0722 * blue > 140 else (255, 255, 255)


def encode_picture(picture: Image.Image, kind: str) -> bytes:
    """Encode `picture` as `kind`: jpeg (quality 85) or png (fast compression)."""
    out = io.BytesIO()
    if kind == "jpeg":
        picture.save(out, "JPEG", quality=JPEG_QUALITY)
    elif kind == "png":
        picture.save(out, "PNG", compress_level=1)
    else:
        raise ValueError(f"no picture type {kind!r}; {', '.join(PICTURE_TYPES)}")
    return out.getvalue()
