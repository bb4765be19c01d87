"""Build a small SavedModel that honours the OD API contract and gives exactly known answers.

It "detects" solid colour blobs: pixels whose red (class 1, score 0.9), green (class 2, score 0.6)
or blue (class 3, score 0.3) channel is above 200 while the other two are below 60. Each class's
box is the bounding box of its pixels, normalized as [ymin, xmin, ymax, xmax] with the far edge
exclusive, so a blob drawn at x0..x1-1 comes back as x_min = x0, x_max = x1 in pixels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CLASS_SCORES = (0.9, 0.6, 0.3)  # red, green, blue
LABEL_MAP = """\
# colour blobs
item { id: 1 name: 'red' display_name: 'Red blob' }
item {
  name: "green"
  id: 2
}
item { id: 3 }  # no name: served as class_3
"""


INPUT_SPECS = {  # exporter_main_v2.py's --input_type: the input's dtype, and its shape after the batch dimension
    "image_tensor": ("uint8", [None, None, 3]),
    "float_image_tensor": ("float32", [None, None, 3]),
    "encoded_image_string_tensor": ("string", []),
}


def build_blob_model(path: Path, batch: int | None = None, busy_products: int = 0, fail_on_width: int = 0,
                     input_type: str = "image_tensor") -> Path:
    """Write the blob detector to `path` (a version folder) and return it.

    `input_type` is the Object Detection API exporter's: `image_tensor` (uint8 pixels), `float_image_tensor`
    (float32 pixels 0 to 255) or `encoded_image_string_tensor` (encoded image files, decoded in the graph
    as the exporter's graph decodes them).

    `busy_products` 512x512 matrix products per call make it slow whatever the image's size (for
    tests that need requests to stay in flight); the answers stay the same. `fail_on_width` makes
    every call on images of that width fail inside the graph, as a model that cannot take an input does.
    """
    import tensorflow as tf

    dtype, rest = INPUT_SPECS[input_type]

    def pixels(input_tensor):
        if input_type != "encoded_image_string_tensor":
            return tf.cast(input_tensor, tf.int32)
        decode = lambda data: tf.io.decode_image(data, channels=3, expand_animations=False)  # noqa: E731
        return tf.cast(tf.map_fn(decode, input_tensor, fn_output_signature=tf.uint8), tf.int32)

    class BlobDetector(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([batch, *rest], tf.dtypes.as_dtype(dtype), name="input_tensor")])
        def detect(self, input_tensor):
            image = pixels(input_tensor)
            shape = tf.shape(image)
            if fail_on_width:
                with tf.control_dependencies([tf.debugging.assert_none_equal(
                        shape[2], fail_on_width, message=f"the model cannot take {fail_on_width} columns")]):
                    image = tf.identity(image)
            height, width = tf.cast(shape[1], tf.float32), tf.cast(shape[2], tf.float32)
            boxes, scores = [], []
            for channel, score in enumerate(CLASS_SCORES):
                others = [c for c in range(3) if c != channel]
                mask = (
                    (image[..., channel] > 200)
                    & (image[..., others[0]] < 60)
                    & (image[..., others[1]] < 60)
                )
                rows = tf.reduce_any(mask, axis=2)  # [B, H]
                cols = tf.reduce_any(mask, axis=1)  # [B, W]
                present = tf.reduce_any(rows, axis=1)
                ys = tf.cast(tf.range(shape[1]), tf.float32)[None, :]
                xs = tf.cast(tf.range(shape[2]), tf.float32)[None, :]
                big = tf.constant(1e9)
                y0 = tf.reduce_min(tf.where(rows, ys, big), axis=1)
                y1 = tf.reduce_max(tf.where(rows, ys, -big), axis=1) + 1
                x0 = tf.reduce_min(tf.where(cols, xs, big), axis=1)
                x1 = tf.reduce_max(tf.where(cols, xs, -big), axis=1) + 1
                box = tf.stack([y0 / height, x0 / width, y1 / height, x1 / width], axis=1)
                boxes.append(tf.where(present[:, None], box, tf.zeros_like(box)))
                scores.append(tf.where(present, score, 0.0))
            boxes = tf.stack(boxes, axis=1)  # [B, 3, 4]
            scores = tf.stack(scores, axis=1)  # [B, 3]
            if busy_products:
                product = tf.foldl(lambda m, _: tf.linalg.normalize(m @ m)[0],
                                   tf.range(busy_products), initializer=tf.eye(512) * 0.5)
                scores += 0.0 * tf.reduce_sum(product)  # keeps the products in the graph; adds exactly 0
            classes = tf.broadcast_to(tf.constant([1.0, 2.0, 3.0]), tf.shape(scores))
            order = tf.argsort(scores, axis=1, direction="DESCENDING", stable=True)
            return {
                "detection_boxes": tf.gather(boxes, order, batch_dims=1),
                "detection_scores": tf.gather(scores, order, batch_dims=1),
                "detection_classes": tf.gather(classes, order, batch_dims=1),
                "num_detections": tf.reduce_sum(tf.cast(scores > 0, tf.float32), axis=1),
                "raw_detection_scores": scores,  # an extra output, as zoo exports have; must be ignored
            }

    module = BlobDetector()
    path.mkdir(parents=True, exist_ok=True)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.detect})
    (path / "label_map.pbtxt").write_text(LABEL_MAP)
    return path


def blob_image(width: int, height: int, blobs: dict[int, tuple[int, int, int, int]],
               background: tuple[int, int, int] = (128, 128, 128)) -> np.ndarray:
    """Draw an RGB image with solid blobs {class id: (x0, y0, x1, y1)}, far edges exclusive."""
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[:] = background
    colours = {1: (255, 0, 0), 2: (0, 255, 0), 3: (0, 0, 255)}
    for class_id, (x0, y0, x1, y1) in blobs.items():
        image[y0:y1, x0:x1] = colours[class_id]
    return image
