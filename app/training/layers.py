"""The few layer types of the shapes networks, in plain TensorFlow, and their serving (folded) form."""

from __future__ import annotations

import math

import tensorflow as tf

BN_EPSILON = 1e-3
BN_MOMENTUM = 0.9  # short training: moving statistics must follow the weights quickly


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


def prior_bias(p: float) -> float:
    """Return the logit bias that makes a sigmoid output start at `p`."""
    return -math.log((1 - p) / p)
