"""Adam with decoupled weight decay (AdamW), as a tf.Module so its moments checkpoint with the network."""

from __future__ import annotations

import tensorflow as tf


class Adam(tf.Module):
    """AdamW over a fixed list of variables; `apply` is called inside the training step's tf.function."""

    def __init__(self, variables, decayed=(), weight_decay: float = 0.0,
                 beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7, name="adam"):
        super().__init__(name=name)
        self._variables = list(variables)
        decayed_ids = {id(v) for v in decayed}
        self._decay = [weight_decay if id(v) in decayed_ids else 0.0 for v in self._variables]
        self.first = [tf.Variable(tf.zeros_like(v), trainable=False) for v in self._variables]
        self.second = [tf.Variable(tf.zeros_like(v), trainable=False) for v in self._variables]
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def apply(self, grads, learning_rate) -> None:
        """Take one step along `grads` (same order as the variables) at `learning_rate`."""
        self.iterations.assign_add(1)
        t = tf.cast(self.iterations, tf.float32)
        corrected = learning_rate * tf.sqrt(1.0 - self.beta_2 ** t) / (1.0 - self.beta_1 ** t)
        for var, grad, m, v, decay in zip(self._variables, grads, self.first, self.second, self._decay):
            m.assign(self.beta_1 * m + (1.0 - self.beta_1) * grad)
            v.assign(self.beta_2 * v + (1.0 - self.beta_2) * tf.square(grad))
            update = corrected * m / (tf.sqrt(v) + self.epsilon)
            if decay:
                update += learning_rate * decay * var
            var.assign_sub(update)
