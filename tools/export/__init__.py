"""The committed models' exporters (objects, faces, with tfjs_graph's conversion) and their accuracy check."""

from tools import ROOT


def reference_jpegs(names: tuple[str, ...]) -> dict[str, bytes]:
    """The parity gate's reference photos (app/inference/parity.py) as JPEG files, by name.

    `astronaut`, `chelsea` and `scene` are the committed samples/ photos, as they are; any other name is a
    scikit-image photo (CC0 ones: `camera`, `coffee`), saved as JPEG at quality 90.
    """
    import io

    photos = {}
    for name in names:
        sample = ROOT / "samples" / f"{name}.jpg"
        if sample.exists():
            photos[sample.name] = sample.read_bytes()
            continue
        import numpy as np
        import skimage.data
        from PIL import Image

        pixels = np.asarray(getattr(skimage.data, name)())
        buffer = io.BytesIO()
        Image.fromarray(pixels).convert("RGB").save(buffer, format="JPEG", quality=90)
        photos[f"{name}.jpg"] = buffer.getvalue()
    return photos
