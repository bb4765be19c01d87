"""The shapes network: a small conv backbone, a feature pyramid merged down to stride 4, two heads.

It is a CenterNet-style detector with TTFNet's box head (Liu et al., "Training-Time-Friendly
Network for Real-Time Object Detection", 2020): per class, a heatmap whose peaks are object
centres; per location, the distances from that location to the box's four sides. TTFNet's head
converges in far fewer steps than CenterNet's size regression, which is what training on two CPU
cores in half an hour needs. Decoding needs no IoU-based NMS: a 3x3 max-pool keeps local peaks.

Plain TensorFlow (no Keras): the variables are few and named, the checkpoint is the module tree,
and export folds each batch norm into its convolution.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import tensorflow as tf

BN_EPSILON = 1e-3
BN_MOMENTUM = 0.9  # short training: moving statistics must follow the weights quickly
PRIOR_SCORE = 0.1  # the heatmap's initial score everywhere, as CenterNet starts it


@dataclass(frozen=True)
class NetConfig:
    """The network's shape; saved beside the checkpoints so export rebuilds the same network."""

    input_size: int = 256  # px, square: every image is resized to this in the graph
    classes: int = 4
    widths: tuple[int, ...] = (24, 48, 72, 96)  # channels at stride 4, 8, 16, 32
    neck: int = 40  # channels of the merged pyramid
    head: int = 32  # channels of the stride-4 features both heads read
    box_scale: float = 16.0  # px of the input per unit of the box head's output

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
        return cls(**{**data, "widths": tuple(data["widths"])})


class ConvBN(tf.Module):
    """A 3x3 or 1x1 convolution, batch norm and (optionally) ReLU."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, relu: bool = True, name=None):
        super().__init__(name=name)
        fan_in = cin * kernel * kernel
        init = tf.random.normal([kernel, kernel, cin, cout], stddev=(2.0 / fan_in) ** 0.5)
        self.kernel = tf.Variable(init, name="kernel")
        self.gamma = tf.Variable(tf.ones([cout]), name="gamma")
        self.beta = tf.Variable(tf.zeros([cout]), name="beta")
        self.mean = tf.Variable(tf.zeros([cout]), trainable=False, name="moving_mean")
        self.var = tf.Variable(tf.ones([cout]), trainable=False, name="moving_variance")
        self.stride, self.relu = stride, relu

    def __call__(self, x, training: bool):
        y = tf.nn.conv2d(x, self.kernel, self.stride, "SAME")
        # The fused op is one kernel forward and one backward, where moments + batch_normalization
        # are a dozen passes over the activations.
        if training:
            y, mean, var = tf.compat.v1.nn.fused_batch_norm(
                y, self.gamma, self.beta, epsilon=BN_EPSILON, is_training=True)
            self.mean.assign(BN_MOMENTUM * self.mean + (1 - BN_MOMENTUM) * mean)
            self.var.assign(BN_MOMENTUM * self.var + (1 - BN_MOMENTUM) * var)
        else:
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(
                y, self.gamma, self.beta, self.mean, self.var, epsilon=BN_EPSILON, is_training=False)
        return tf.nn.relu(y) if self.relu else y

    def folded(self) -> tuple[tf.Tensor, tf.Tensor]:
        """Return (kernel, bias) of the one convolution equal to this conv + batch norm at inference."""
        scale = self.gamma / tf.sqrt(self.var + BN_EPSILON)
        return self.kernel * scale, self.beta - self.mean * scale


class Conv(tf.Module):
    """A 1x1 convolution with bias: the heads' last layer."""

    def __init__(self, cin: int, cout: int, bias: float = 0.0, name=None):
        super().__init__(name=name)
        self.kernel = tf.Variable(tf.random.normal([1, 1, cin, cout], stddev=0.01), name="kernel")
        self.bias = tf.Variable(tf.fill([cout], bias), name="bias")

    def __call__(self, x, training: bool = False):
        return tf.nn.conv2d(x, self.kernel, 1, "SAME") + self.bias

    def folded(self) -> tuple[tf.Tensor, tf.Tensor]:
        return self.kernel, self.bias


class FoldedConv(tf.Module):
    """A convolution with bias and (optionally) ReLU: a ConvBN with its batch norm folded in, for serving."""

    def __init__(self, layer, name=None):
        super().__init__(name=name)
        kernel, bias = layer.folded()
        self.kernel = tf.Variable(kernel, trainable=False, name="kernel")
        self.bias = tf.Variable(bias, trainable=False, name="bias")
        self.stride = getattr(layer, "stride", 1)
        self.relu = getattr(layer, "relu", False)

    def __call__(self, x, training: bool = False):
        y = tf.nn.conv2d(x, self.kernel, self.stride, "SAME") + self.bias
        return tf.nn.relu(y) if self.relu else y


class ShapesNet(tf.Module):
    """Image [B, S, S, 3] float in [-1, 1] -> heatmap logits [B, G, G, C] and box head output [B, G, G, 4].

    The stem folds each 4x4 pixel block into channels (space-to-depth) and convolves at stride 4
    straight away: convolutions of 3 input channels at full resolution are the slowest per
    multiply-add on a CPU, forward and backward. `layers` None builds fresh trainable layers;
    `fold` passes the folded ones of a trained network.
    """

    def __init__(self, config: NetConfig, layers: dict | None = None, name="shapes_net"):
        super().__init__(name=name)
        self.config = config
        self.layers = layers if layers is not None else _fresh_layers(config)

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


def _fresh_layers(config: NetConfig) -> dict:
    w, n, h = config.widths, config.neck, config.head
    return {
        "stem": [ConvBN(48, w[0])],
        "down8": [ConvBN(w[0], w[1], stride=2), ConvBN(w[1], w[1])],
        "down16": [ConvBN(w[1], w[2], stride=2), ConvBN(w[2], w[2]), ConvBN(w[2], w[2])],
        "down32": [ConvBN(w[2], w[3], stride=2), ConvBN(w[3], w[3])],
        "top": [ConvBN(w[3], n, kernel=1)],
        "lateral": [ConvBN(w[2], n, kernel=1), ConvBN(w[1], n, kernel=1), ConvBN(w[0], n, kernel=1)],
        "merge": [ConvBN(n, n), ConvBN(n, n), ConvBN(n, h)],
        "heat": [Conv(h, config.classes, bias=-_logit(PRIOR_SCORE))],
        "box": [Conv(h, 4)],
    }


def fold(net: ShapesNet) -> ShapesNet:
    """Return the serving copy of a trained network: every batch norm folded into its convolution."""
    layers = {group: [FoldedConv(layer) for layer in members] for group, members in net.layers.items()}
    return ShapesNet(net.config, layers=layers, name="shapes_net_folded")


def _logit(p: float) -> float:
    import math

    return math.log((1 - p) / p)


def _upsample2(x):
    """Nearest-neighbour 2x upsampling; tf.repeat, unlike resize, has a gradient XLA can compile."""
    return tf.repeat(tf.repeat(x, 2, axis=1), 2, axis=2)


def preprocess(images, size: int):
    """Resize uint8 images [B, H, W, 3] to [B, size, size, 3] floats in [-1, 1]; shared by training and serving."""
    resized = tf.image.resize(tf.cast(images, tf.float32), [size, size], antialias=True)
    return resized / 127.5 - 1.0


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
