"""Generate the synthetic "shapes" data set: cluttered, textured scenes with boxed, labelled shapes.

Every scene is a pure function of (stream, seed, index): the training stream and the held-out
stream draw from different seed sequences, so no held-out scene is ever a training scene, whatever
seed training is given. Scenes vary in size (short side 160-480 px) and aspect ratio (1:2 to 2:1);
each holds 1-10 shapes of 5-50% of the short side, in random colours, fills and rotations, which may
overlap but leave at least `MIN_VISIBLE` of each shape in view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

CLASSES = ("circle", "square", "triangle", "star")  # class id = position + 1
STREAMS = {"train": 0, "heldout": 1}
HELDOUT_SEED = 20261202  # the fixed held-out set: stream "heldout", this seed, indices 0..n-1

SHORT_SIDE = (160, 480)  # px
ASPECT = (0.5, 2.0)  # width / height
SIZE_FRACTION = (0.05, 0.5)  # a shape's outer diameter over the scene's short side, log-uniform
OBJECTS = (1, 10)
MIN_VISIBLE = 0.6  # share of a shape's own area that later shapes may not cover
MIN_CONTRAST = 70.0  # RGB distance between a shape's colour and the background under it

# Standard normal quantiles at 256 evenly spaced probabilities: random bytes looked up here give
# Gaussian noise several times faster than drawing normals.
_NORMAL_QUANTILES = np.array([NormalDist().inv_cdf((i + 0.5) / 256) for i in range(256)], np.float32)


@dataclass(frozen=True)
class Scene:
    """One generated image and its ground truth."""

    image: np.ndarray  # [H, W, 3] uint8 RGB
    boxes: np.ndarray  # [N, 4] float32 pixels x_min, y_min, x_max, y_max; far edges exclusive
    classes: np.ndarray  # [N] int32, 1-based into CLASSES

    @property
    def normalized_boxes(self) -> np.ndarray:
        """Return boxes as [N, 4] normalized ymin, xmin, ymax, xmax, as the detection contract has them."""
        height, width = self.image.shape[:2]
        x0, y0, x1, y1 = self.boxes.T if len(self.boxes) else np.zeros((4, 0), np.float32)
        return np.stack([y0 / height, x0 / width, y1 / height, x1 / width], axis=1).astype(np.float32)


def scene(stream: str, seed: int, index: int) -> Scene:
    """Return scene `index` of a stream ('train' or 'heldout') and seed; the same arguments, the same scene."""
    return render_scene(np.random.default_rng([STREAMS[stream], seed, index]))


def heldout_scenes(count: int, seed: int = HELDOUT_SEED) -> list[Scene]:
    """Return the first `count` scenes of the fixed held-out set."""
    return [scene("heldout", seed, i) for i in range(count)]


def render_scene(rng: np.random.Generator) -> Scene:
    """Draw one scene: background texture, clutter, shapes, a few lines on top, blur and noise."""
    width, height = _scene_size(rng)
    canvas = Image.fromarray(_background(rng, height, width))
    _clutter(rng, canvas, count=int(rng.integers(0, 25)))
    image = np.array(canvas, dtype=np.uint8)
    boxes, classes = _place_shapes(rng, image)
    canvas = Image.fromarray(image)
    if rng.random() < 0.3:
        _clutter(rng, canvas, count=int(rng.integers(1, 4)), thin=True)
    if rng.random() < 0.3:
        canvas = canvas.filter(ImageFilter.BoxBlur(radius=float(rng.uniform(0.5, 1.0))))
    image = np.asarray(canvas, dtype=np.uint8)
    sigma = rng.uniform(0.0, 10.0)
    if sigma > 1.0:  # grey sensor noise, one draw per pixel shared by the channels
        levels = np.rint(_NORMAL_QUANTILES * sigma).astype(np.int16)
        noise = levels[rng.integers(0, 256, (height, width, 1), dtype=np.uint8)]
        image = np.clip(image + noise, 0, 255).astype(np.uint8)
    return Scene(image=image, boxes=np.array(boxes, np.float32).reshape(-1, 4),
                 classes=np.array(classes, np.int32))


def _scene_size(rng) -> tuple[int, int]:
    short = rng.uniform(*SHORT_SIDE)
    ratio = math.exp(rng.uniform(math.log(ASPECT[0]), math.log(ASPECT[1])))
    width, height = (short * ratio, short) if ratio >= 1 else (short, short / ratio)
    return int(round(width)), int(round(height))


def _colour(rng) -> np.ndarray:
    return rng.uniform(0, 255, 3).astype(np.float32)


def _background(rng, height: int, width: int) -> np.ndarray:
    """Return a textured background: one or two of smooth noise, stripes, checks, gradient.

    Textures are computed at half resolution and enlarged, which is four times cheaper and
    softens their edges a little, as a camera would.
    """
    low_h, low_w = max(height // 2, 1), max(width // 2, 1)
    pixels = _texture(rng, low_h, low_w)
    if rng.random() < 0.4:
        alpha = rng.uniform(0.3, 0.7)
        pixels = alpha * pixels + (1 - alpha) * _texture(rng, low_h, low_w)
    low = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return np.asarray(low.resize((width, height), Image.BILINEAR))


def _texture(rng, height: int, width: int) -> np.ndarray:
    kind = rng.integers(4)
    if kind == 0:  # smooth colour noise
        cells = rng.integers(2, 12, size=2)
        low = rng.uniform(0, 255, (cells[0], cells[1], 3)).astype(np.uint8)
        return np.asarray(Image.fromarray(low).resize((width, height), Image.BICUBIC), np.float32)
    ys = np.arange(height, dtype=np.float32)[:, None]
    xs = np.arange(width, dtype=np.float32)[None, :]
    angle = rng.uniform(0, math.pi)
    u = xs * math.cos(angle) + ys * math.sin(angle)
    a, b = _colour(rng), _colour(rng)
    if kind == 1:  # stripes, hard or soft
        period = rng.uniform(2, 24)
        wave = 0.5 + 0.5 * np.sin(u * np.float32(2 * math.pi / period))
        t = wave if rng.random() < 0.5 else (wave > 0.5).astype(np.float32)
    elif kind == 2:  # checks
        cell = rng.uniform(2, 20)
        v = ys * math.cos(angle) - xs * math.sin(angle)
        t = ((np.floor(u / cell) + np.floor(v / cell)) % 2).astype(np.float32)
    else:  # linear gradient
        t = (u - u.min()) / max(float(u.max() - u.min()), 1.0)
    return a + t[..., None] * (b - a)


def _clutter(rng, canvas: Image.Image, count: int, thin: bool = False) -> None:
    """Draw `count` distractors that are none of the classes: segments, polylines and arcs."""
    draw = ImageDraw.Draw(canvas)
    width, height = canvas.size
    for _ in range(count):
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        line_width = 1 if thin else int(rng.integers(1, 5))
        kind = rng.integers(3)
        if kind == 0:
            points = [(float(rng.uniform(0, width)), float(rng.uniform(0, height))) for _ in range(2)]
            draw.line(points, fill=colour, width=line_width)
        elif kind == 1:
            start = rng.uniform([0, 0], [width, height])
            steps = rng.normal(0, 0.1 * min(width, height), (int(rng.integers(3, 8)), 2))
            points = [tuple(float(c) for c in p) for p in start + np.cumsum(steps, axis=0)]
            draw.line(points, fill=colour, width=line_width, joint="curve")
        else:
            radius = rng.uniform(0.05, 0.4) * min(width, height)
            cx, cy = rng.uniform(0, width), rng.uniform(0, height)
            start = float(rng.uniform(0, 360))
            draw.arc([cx - radius, cy - radius, cx + radius, cy + radius], start,
                     start + float(rng.uniform(30, 200)), fill=colour, width=line_width)


def _outline(class_id: int, radius: float, angle: float, rng) -> list[tuple[float, float]]:
    """Return the polygon of a square, triangle or star of outer radius `radius`, centred on 0."""
    if class_id == 2:
        angles = angle + np.arange(4) * (math.pi / 2)
        radii = np.full(4, radius)
    elif class_id == 3:
        angles = angle + np.arange(3) * (2 * math.pi / 3) + rng.uniform(-0.25, 0.25, 3)
        radii = np.full(3, radius)
    else:
        angles = angle + np.arange(10) * (math.pi / 5)
        radii = np.where(np.arange(10) % 2 == 0, radius, radius * rng.uniform(0.38, 0.55))
    return [(float(r * math.cos(a)), float(r * math.sin(a))) for r, a in zip(radii, angles)]


def _shape_mask(class_id: int, cx: float, cy: float, radius: float, rng) -> tuple[np.ndarray, int, int]:
    """Rasterize one shape; return its mask over a local window and the window's top-left corner."""
    left, top = int(math.floor(cx - radius)) - 1, int(math.floor(cy - radius)) - 1
    size = int(math.ceil(2 * radius)) + 3
    window = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(window)
    lx, ly = cx - left, cy - top
    if class_id == 1:
        draw.ellipse([lx - radius, ly - radius, lx + radius, ly + radius], fill=255)
    else:
        points = [(lx + x, ly + y) for x, y in _outline(class_id, radius, rng.uniform(0, 2 * math.pi), rng)]
        draw.polygon(points, fill=255)
    return np.asarray(window) > 0, left, top


def _place_shapes(rng, image: np.ndarray) -> tuple[list, list]:
    """Paint shapes onto `image` in place; return their boxes and class ids."""
    height, width = image.shape[:2]
    short = min(height, width)
    owner = np.full((height, width), -1, np.int32)  # which shape each pixel shows, -1: background
    areas: list[int] = []
    visible: list[int] = []
    boxes, classes = [], []
    for _ in range(int(rng.integers(OBJECTS[0], OBJECTS[1] + 1))):
        for _attempt in range(20):
            class_id = int(rng.integers(1, len(CLASSES) + 1))
            fraction = math.exp(rng.uniform(math.log(SIZE_FRACTION[0]), math.log(SIZE_FRACTION[1])))
            radius = fraction * short / 2
            cx, cy = rng.uniform(radius, width - radius), rng.uniform(radius, height - radius)
            mask, left, top = _shape_mask(class_id, cx, cy, radius, rng)
            mask = _clip_window(mask, left, top, height, width)
            if mask is None:
                continue
            window, (y0, y1, x0, x1) = mask
            under = owner[y0:y1, x0:x1][window]
            covered = np.bincount(under[under >= 0], minlength=len(areas))
            if all(visible[j] - covered[j] >= MIN_VISIBLE * areas[j] for j in range(len(areas))):
                break
        else:
            continue
        region = image[y0:y1, x0:x1]
        region[window] = _fill(rng, region[window].astype(np.float32), window)
        owner[y0:y1, x0:x1][window] = len(areas)
        visible = [v - int(c) for v, c in zip(visible, covered)] + [int(window.sum())]
        areas.append(int(window.sum()))
        rows, cols = np.nonzero(window)
        boxes.append((x0 + cols.min(), y0 + rows.min(), x0 + cols.max() + 1, y0 + rows.max() + 1))
        classes.append(class_id)
    return boxes, classes


def _clip_window(mask, left, top, height, width):
    """Cut a local mask to the image; None if fewer than 9 pixels remain."""
    y0, x0 = max(top, 0), max(left, 0)
    y1, x1 = min(top + mask.shape[0], height), min(left + mask.shape[1], width)
    window = mask[y0 - top:y1 - top, x0 - left:x1 - left]
    if window.sum() < 9:
        return None
    return window, (y0, y1, x0, x1)


def _fill(rng, under: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Return the colours of a shape's pixels: solid or a gradient, contrasting with what is under it."""
    mean = under.mean(axis=0)
    colour = _colour(rng)
    for _ in range(10):
        if np.linalg.norm(colour - mean) >= MIN_CONTRAST:
            break
        colour = _colour(rng)
    else:
        colour = 255.0 - mean
    count = int(window.sum())
    if rng.random() < 0.35:  # a gradient towards a second, nearby colour, across the shape
        other = np.clip(colour + rng.uniform(-60, 60, 3), 0, 255)
        rows, cols = np.nonzero(window)
        angle = rng.uniform(0, 2 * math.pi)
        u = cols * math.cos(angle) + rows * math.sin(angle)
        t = ((u - u.min()) / max(float(np.ptp(u)), 1.0))[:, None]
        return (colour + t * (other - colour)).astype(np.float32)
    return np.broadcast_to(colour, (count, 3))
