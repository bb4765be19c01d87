"""Process-wide setup, done once where a process starts rather than as a side effect of an import.

`configure_cuda_order` runs in every process that may load TensorFlow (model workers, training,
calibration); `configure_pillow` in every process that decodes uploads (the HTTP process, benchmarks).
"""

from __future__ import annotations

import os

# Pillow inflates PNG text chunks (tEXt, zTXt, iTXt) at open, up to 1 MiB each and 64 MiB in all; 64 MiB per
# image, in each of the request threads at once, is memory and time no detection needs. 4 MiB keeps any real
# metadata (XMP, comments) and turns a pile of 1 MiB text bombs into a quick 400.
PNG_TEXT_MEMORY_CHUNKS = 4


def configure_cuda_order(environ=None) -> None:
    """Number GPUs as nvidia-smi and NVML do (PCI bus order), before CUDA initializes.

    CUDA's default order is "fastest first", so without this DETECT_GPUS=1 could be another GPU than
    nvidia-smi's GPU 1.
    """
    (os.environ if environ is None else environ).setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


def configure_pillow() -> None:
    """Set Pillow's process-wide decoding limits for untrusted uploads."""
    from PIL import Image, PngImagePlugin

    # The service checks max_image_pixels itself, from the header, before decoding; Pillow's own bomb check
    # would otherwise warn or raise at its fixed limit, whatever the setting says.
    Image.MAX_IMAGE_PIXELS = None
    PngImagePlugin.MAX_TEXT_MEMORY = PNG_TEXT_MEMORY_CHUNKS * PngImagePlugin.MAX_TEXT_CHUNK
