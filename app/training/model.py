"""The shapes detector: a class-agnostic CenterNet-style locator, then a small classifier on crops.

Stage 1, the locator, sees the whole image resized to a square: a conv backbone, a feature
pyramid merged down to stride 4, an objectness heatmap whose peaks are object centres and, per
cell, TTFNet's distances to the box's four sides (Liu et al., "Training-Time-Friendly Network for
Real-Time Object Detection", 2020). A 3x3 max-pool keeps the heatmap's local peaks: the NMS.

Stage 2, the classifier, sees each of the best peaks' boxes (with some context) cropped from the
original image and resized to CROP_SIZE: the shape at one scale, whatever its size in the image.
One dense head would have to learn every shape at every scale from one centre cell per object;
on two CPU cores in half an hour it learns where objects are long before it learns which.

Plain TensorFlow (no Keras): the variables are few and named, the checkpoint is the module tree,
and export folds each batch norm into its convolution.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import tensorflow as tf

from .layers import Conv, ConvBN, FoldedConv, prior_bias

PRIOR_SCORE = 0.1  # the heatmap's initial score everywhere, as CenterNet starts it
CROP_SIZE = 32  # px, square: what the classifier sees of each object
CROP_CONTEXT = 0.15  # the crop adds this share of the box's size on each side


@dataclass(frozen=True)
class NetConfig:
    """The networks' shape; saved beside the checkpoints so export rebuilds the same networks."""

    input_size: int = 256  # px, square: the locator sees every image resized to this
    classes: int = 4
    widths: tuple[int, ...] = (24, 48, 72, 96)  # locator channels at stride 4, 8, 16, 32
    neck: int = 40  # channels of the merged pyramid
    head: int = 32  # channels of the stride-4 features both locator heads read
    box_scale: float = 16.0  # px of the input per unit of the box head's output
    classifier_widths: tuple[int, ...] = (24, 48, 64)  # at 1/2, 1/4, 1/8 of the crop

    @property
    def stride(self) -> int:
        return 4

    @property
    def grid(self) -> int:
        return self.input_size // self.stride

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "NetConfig":
        tuples = {k: tuple(data[k]) for k in ("widths", "classifier_widths") if k in data}
        return cls(**{**data, **tuples})


class Locator(tf.Module):
    """Image [B, S, S, 3] in [-1, 1] -> objectness logits [B, G, G, 1] and box head output [B, G, G, 4].

    The stem folds each 4x4 pixel block into channels (space-to-depth) and convolves at stride 4
    straight away: convolutions of 3 input channels at full resolution are the slowest per
    multiply-add on a CPU, forward and backward.
    """

    def __init__(self, config: NetConfig, layers: dict | None = None, name="locator"):
        super().__init__(name=name)
        self.layers = layers if layers is not None else _locator_layers(config)

    def __call__(self, images, training: bool):
        groups = self.layers
        x = tf.nn.space_to_depth(images, 4)
        features = []
        for group in ("stem", "down8", "down16", "down32"):
            for layer in groups[group]:
                x = layer(x, training)
            features.append(x)
        y = groups["top"][0](x, training)
        for lateral, merge, skip in zip(groups["lateral"], groups["merge"], reversed(features[:-1])):
            y = merge(_upsample2(y) + lateral(skip, training), training)
        return groups["heat"][0](y), groups["box"][0](y)


def _locator_layers(config: NetConfig) -> dict:
    w, n, h = config.widths, config.neck, config.head
    return {
        "stem": [ConvBN(48, w[0])],
        "down8": [ConvBN(w[0], w[1], stride=2), ConvBN(w[1], w[1])],
        "down16": [ConvBN(w[1], w[2], stride=2), ConvBN(w[2], w[2]), ConvBN(w[2], w[2])],
        "down32": [ConvBN(w[2], w[3], stride=2), ConvBN(w[3], w[3])],
        "top": [ConvBN(w[3], n, kernel=1)],
        "lateral": [ConvBN(w[2], n, kernel=1), ConvBN(w[1], n, kernel=1), ConvBN(w[0], n, kernel=1)],
        "merge": [ConvBN(n, n), ConvBN(n, n), ConvBN(n, h)],
        "heat": [Conv(h, 1, bias=prior_bias(PRIOR_SCORE))],
        "box": [Conv(h, 4)],
    }


class ShapeClassifier(tf.Module):
    """Crops [N, CROP_SIZE, CROP_SIZE, 3] in [-1, 1] -> logits [N, classes + 1]; index 0 is 'no shape'."""

    def __init__(self, config: NetConfig, layers: dict | None = None, name="classifier"):
        super().__init__(name=name)
        self.layers = layers if layers is not None else _classifier_layers(config)

    def __call__(self, crops, training: bool):
        x = tf.nn.space_to_depth(crops, 2)
        for layer in self.layers["convs"]:
            x = layer(x, training)
        pooled = tf.reduce_mean(x, axis=[1, 2], keepdims=True)
        return tf.squeeze(self.layers["out"][0](pooled), axis=[1, 2])


def _classifier_layers(config: NetConfig) -> dict:
    a, b, c = config.classifier_widths
    return {
        "convs": [ConvBN(12, a), ConvBN(a, b, stride=2), ConvBN(b, b), ConvBN(b, c, stride=2), ConvBN(c, c)],
        "out": [Conv(c, config.classes + 1)],
    }


class ShapesNet(tf.Module):
    """Both stages, checkpointed together."""

    def __init__(self, config: NetConfig, locator=None, classifier=None, name="shapes_net"):
        super().__init__(name=name)
        self.config = config
        self.locator = locator if locator is not None else Locator(config)
        self.classifier = classifier if classifier is not None else ShapeClassifier(config)


def fold(net: ShapesNet) -> ShapesNet:
    """Return the serving copy of a trained network: every batch norm folded into its convolution."""
    def folded(layers):
        return {group: [FoldedConv(layer) for layer in members] for group, members in layers.items()}

    return ShapesNet(net.config, locator=Locator(net.config, folded(net.locator.layers)),
                     classifier=ShapeClassifier(net.config, folded(net.classifier.layers)),
                     name="shapes_net_folded")


def _upsample2(x):
    """Nearest-neighbour 2x upsampling; tf.repeat, unlike resize, has a gradient XLA can compile."""
    return tf.repeat(tf.repeat(x, 2, axis=1), 2, axis=2)


def preprocess(images, size: int):
    """Resize uint8 images [B, H, W, 3] to [B, size, size, 3] floats in [-1, 1]; shared by training and serving."""
    # ScaleAndTranslate reads uint8 as it is and computes in float32: the same result as casting
    # first, without a float32 copy of the whole image (14% less CPU at 640x480).
    resized = tf.image.resize(images, [size, size], antialias=True)
    return resized / 127.5 - 1.0


def crop_objects(images, boxes, box_indices):
    """Crop boxes [N, 4] (normalized ymin, xmin, ymax, xmax) widened by CROP_CONTEXT from uint8 images.

    Returns [N, CROP_SIZE, CROP_SIZE, 3] floats in [-1, 1]; outside the image is mid-grey. Shared
    by training (ground-truth boxes, jittered) and serving (the locator's boxes).
    """
    y0, x0, y1, x1 = tf.unstack(boxes, axis=-1)
    dy, dx = CROP_CONTEXT * (y1 - y0), CROP_CONTEXT * (x1 - x0)
    wide = tf.stack([y0 - dy, x0 - dx, y1 + dy, x1 + dx], axis=-1)
    crops = tf.image.crop_and_resize(images, wide, box_indices, [CROP_SIZE, CROP_SIZE],
                                     extrapolation_value=127.5)
    return crops / 127.5 - 1.0


def box_distances(raw, box_scale: float):
    """Turn the box head's output into distances (left, top, right, bottom) in input px, all positive."""
    return tf.nn.softplus(raw) * box_scale


def cell_centres(config: NetConfig):
    """Return [G, G, 2] (x, y) centres of the output cells, in input px."""
    centres = (tf.range(config.grid, dtype=tf.float32) + 0.5) * config.stride
    xs, ys = tf.meshgrid(centres, centres)
    return tf.stack([xs, ys], axis=-1)


def decode_boxes(distances, config: NetConfig):
    """Turn distances [B, G, G, 4] into boxes [B, G, G, 4] as x_min, y_min, x_max, y_max in input px."""
    centres = cell_centres(config)
    return tf.concat([centres - distances[..., :2], centres + distances[..., 2:]], axis=-1)
