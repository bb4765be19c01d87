"""A model's working size: the fewest pixels it needs, so images may be decoded no larger than that.

A version folder may hold `model_info.json`. Its `working_size` object (`width`, `height`,
`longest_side`, any of them, in pixels as the user sees the image, and optionally `scale_step`)
names the size outright; else its `input_size` (`width`, `height`: what the graph resizes every
image to) is the working size. A model with neither has none and is decoded at full size. Only
JSON is read here: the HTTP process, which never imports TensorFlow, calls `read_working_size`.

Two ways to reduce. By default an image is divided by the largest whole factor k that still
covers the working size (a JPEG by its decoder's 1/2, 1/4 or 1/8, then a box average by what is
left). With `scale_step` (a cascade's pyramid step, such as MTCNN's 0.709) it is scaled only by a
whole power of the step: the cascade's own pyramid then visits the same scales of the photo as
at full size, less the finest ones, and its answers stay those of the full-size image.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import ModelError

MODEL_INFO = "model_info.json"
_SIDES = ("width", "height", "longest_side")


@dataclass(frozen=True)
class WorkingSize:
    """What a decoded image must still cover, as displayed (after EXIF orientation); 0: no bound."""

    width: int = 0  # columns the model needs, at least
    height: int = 0  # rows the model needs, at least
    longest_side: int = 0  # pixels along the image's longer side, at least
    scale_step: float = 0.0  # in (0, 1): scale only by its whole powers; 0: divide by whole factors

    def covers(self, width: float, height: float) -> bool:
        """Whether an image of width x height (fractions allowed) still holds what the model needs."""
        return width >= self.width and height >= self.height and max(width, height) >= self.longest_side

    def reduction(self, width: int, height: int) -> int:
        """Return the largest whole k such that a width x height image divided by k still covers this size.

        1 means keep every pixel: an image at or under the working size is never reduced, and never enlarged.
        """
        bounds = [side // need for side, need in ((width, self.width), (height, self.height),
                                                  (max(width, height), self.longest_side)) if need > 0]
        return max(1, min(bounds)) if bounds else 1

    def scale(self, width: int, height: int) -> float:
        """Return the smallest scale (at most 1) a width x height image may be decoded at."""
        if not self.scale_step:
            return 1.0 / self.reduction(width, height)
        scale = 1.0
        if self.width or self.height or self.longest_side:  # else no bound, and no reduction
            while self.covers(width * scale * self.scale_step, height * scale * self.scale_step):
                scale *= self.scale_step
        return scale

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """Return the size a width x height image is decoded at: reduced by `scale`, rounded."""
        scale = self.scale(width, height)
        return max(1, round(width * scale)), max(1, round(height * scale))

    def describe(self) -> str:
        """Say it in words for the log, e.g. 'at least 256x256' or 'longest side at least 1920'."""
        parts = []
        if self.width or self.height:
            parts.append(f"at least {self.width or 'any'}x{self.height or 'any'}")
        if self.longest_side:
            parts.append(f"longest side at least {self.longest_side}")
        if self.scale_step:
            parts.append(f"scaled by whole powers of {self.scale_step:g}")
        return ", ".join(parts) or "no bound"


def read_working_size(version_folder: str | Path) -> Optional[WorkingSize]:
    """Return the working size that a version folder's model_info.json declares, or None.

    Raise ModelError naming the file when it exists but cannot be read or holds a bad size.
    """
    path = Path(version_folder) / MODEL_INFO
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(info, dict):
        raise ModelError(f"{path} must hold a JSON object")
    if "working_size" in info:
        return _parse(path, "working_size", info["working_size"], (*_SIDES, "scale_step"))
    if "input_size" in info:
        return _parse(path, "input_size", info["input_size"], ("width", "height"))
    return None


def _parse(path: Path, key: str, value, allowed: tuple[str, ...]) -> WorkingSize:
    if not isinstance(value, dict) or not set(value) & set(_SIDES) or set(value) - set(allowed):
        raise ModelError(f"{path}: {key} must be an object with some of {', '.join(allowed)}; it is {value!r}")
    for name, number in value.items():
        if name == "scale_step":
            if type(number) not in (int, float) or not 0 < number < 1:
                raise ModelError(f"{path}: {key}.scale_step must be a number between 0 and 1; it is {number!r}")
        elif type(number) is not int or number < 1:
            raise ModelError(f"{path}: {key}.{name} must be a whole number of pixels, 1 or more; it is {number!r}")
    return WorkingSize(**value)
