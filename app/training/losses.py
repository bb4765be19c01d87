"""The training losses: CenterNet's focal loss on the heatmap, TTFNet's weighted GIoU on the boxes, crops' cross-entropy."""

from __future__ import annotations

import tensorflow as tf


def heatmap_loss(logits, target):
    """Penalty-reduced focal loss (CenterNet), summed over the batch and divided by its object count.

    `target` is 1 exactly at object centres and a Gaussian around them; negatives near a centre
    are down-weighted by (1 - target)^4.
    """
    positive = tf.cast(target >= 1.0 - 1e-4, tf.float32)
    p = tf.sigmoid(logits)
    log_p = tf.math.log_sigmoid(logits)
    log_not_p = tf.math.log_sigmoid(-logits)
    positive_loss = -log_p * tf.square(1.0 - p) * positive
    negative_loss = -log_not_p * tf.square(p) * tf.pow(1.0 - target, 4.0) * (1.0 - positive)
    count = tf.maximum(tf.reduce_sum(positive), 1.0)
    return (tf.reduce_sum(positive_loss) + tf.reduce_sum(negative_loss)) / count


def box_loss(predicted, target, weight):
    """GIoU loss of boxes [..., 4] (x_min, y_min, x_max, y_max), weighted per cell, normalized by the weights."""
    px0, py0, px1, py1 = tf.unstack(predicted, axis=-1)
    tx0, ty0, tx1, ty1 = tf.unstack(target, axis=-1)
    predicted_area = (px1 - px0) * (py1 - py0)
    target_area = (tx1 - tx0) * (ty1 - ty0)
    overlap = (tf.nn.relu(tf.minimum(px1, tx1) - tf.maximum(px0, tx0))
               * tf.nn.relu(tf.minimum(py1, ty1) - tf.maximum(py0, ty0)))
    union = predicted_area + target_area - overlap
    hull = (tf.maximum(px1, tx1) - tf.minimum(px0, tx0)) * (tf.maximum(py1, ty1) - tf.minimum(py0, ty0))
    giou = overlap / tf.maximum(union, 1e-6) - (hull - union) / tf.maximum(hull, 1e-6)
    return tf.reduce_sum(weight * (1.0 - giou)) / (tf.reduce_sum(weight) + 1e-4)


def classifier_loss(logits, labels):
    """Mean cross-entropy of crop logits [N, C + 1] against labels [N]; labels -1 (unused slots) count nothing."""
    used = labels >= 0
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.maximum(labels, 0), logits=logits)
    weights = tf.cast(used, tf.float32)
    return tf.reduce_sum(losses * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)
