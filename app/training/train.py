"""Train the shapes network on scenes generated on the fly; checkpoint, resume, log to TensorBoard.

Scene `i` of the training stream is the same for a given seed whatever happened before, and step
`s` trains on scenes s*B .. s*B+B-1, so a run resumed from a checkpoint at step s sees exactly the
scenes an uninterrupted run would have seen. The caller applies the GPU memory policy first:
nothing here may run before `setup_gpus`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, TextIO

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from ..gpu.memory_policy import tensorflow_memory_info
from .data import STREAMS, scene
from .losses import box_loss, classifier_loss, heatmap_loss
from .model import NetConfig, ShapesNet, box_distances, crop_objects, decode_boxes, preprocess
from .optim import Adam
from .progress import ProgressBar
from .targets import CROP_SLOTS, encode, sample_crops

BOX_LOSS_WEIGHT = 5.0  # TTFNet's balance of the box loss against the heatmap loss
CROP_STREAM = len(STREAMS)  # seeds the crops' jitter apart from every scene stream
CONFIG_FILE = "net_config.json"

# tf.summary.scalar lives in the tensorboard package, which serving does not need; tf.summary.write
# with the scalars plugin's metadata writes the very same event, which TensorBoard shows as a scalar.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))


@dataclass(frozen=True)
class TrainConfig:
    """How to train: the schedule and where to write; the network's shape is NetConfig."""

    steps: int = 4000
    batch_size: int = 16
    learning_rate: float = 2e-3  # peak, after warm-up; cosine decay to 2% of it at the last step
    warmup_steps: int = 100
    weight_decay: float = 1e-4  # decoupled, on convolution kernels only
    seed: int = 0
    logdir: Path = Path("runs/shapes")
    checkpoint_every: int = 100  # steps
    summary_every: int = 10  # steps

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.logdir) / "checkpoints"


def learning_rate(step, config: TrainConfig):
    """Return the learning rate at `step` (a tensor): linear warm-up, then cosine decay."""
    step = tf.cast(step, tf.float32)
    peak = config.learning_rate
    warmup = float(max(min(config.warmup_steps, config.steps // 5), 1))
    warm = peak * (0.1 + 0.9 * step / warmup)
    progress = tf.clip_by_value((step - warmup) / max(config.steps - warmup, 1.0), 0.0, 1.0)
    cosine = peak * (0.02 + 0.98 * 0.5 * (1.0 + tf.cos(math.pi * progress)))
    return tf.where(step < warmup, warm, cosine)


def training_batches(net_config: NetConfig, seed: int, batch_size: int, start_step: int) -> tf.data.Dataset:
    """Return batches (images, heatmaps, box targets, box weights, crops, crop labels) from `start_step` on."""
    grid, stride = net_config.grid, net_config.stride

    def examples():
        index = start_step * batch_size
        while True:
            shot = scene("train", seed, index)
            boxes = shot.normalized_boxes
            heat, target, weight = encode(boxes, np.ones_like(shot.classes), grid, stride, 1)
            crops, labels = sample_crops(boxes, shot.classes, np.random.default_rng([CROP_STREAM, seed, index]))
            yield shot.image, heat, target, weight, crops, labels
            index += 1

    signature = (
        tf.TensorSpec([None, None, 3], tf.uint8),
        tf.TensorSpec([grid, grid, 1], tf.float32),
        tf.TensorSpec([grid, grid, 4], tf.float32),
        tf.TensorSpec([grid, grid], tf.float32),
        tf.TensorSpec([CROP_SLOTS, 4], tf.float32),
        tf.TensorSpec([CROP_SLOTS], tf.int32),
    )
    size = net_config.input_size

    def prepare(image, heat, target, weight, crop_boxes, labels):
        crops = crop_objects(image[None], crop_boxes, tf.zeros([CROP_SLOTS], tf.int32))
        return preprocess(image[None], size)[0], heat, target, weight, crops, labels

    return (
        tf.data.Dataset.from_generator(examples, output_signature=signature)
        .map(prepare, num_parallel_calls=2, deterministic=True)
        .batch(batch_size, drop_remainder=True)
        .prefetch(2)
    )


class Trainer:
    """The network, optimizer and step counter, checkpointed together; `run` trains to `config.steps`."""

    def __init__(self, config: TrainConfig, net_config: Optional[NetConfig] = None):
        self.config = config
        self.net_config = _net_config(config.checkpoint_dir, net_config or NetConfig())
        tf.random.set_seed(config.seed)
        self.net = ShapesNet(self.net_config)
        self.variables = list(self.net.trainable_variables)
        decay = [v for v in self.variables if v.name.startswith("kernel")]
        self.optimizer = Adam(self.variables, decayed=decay, weight_decay=config.weight_decay)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.checkpoint = tf.train.Checkpoint(step=self.step, net=self.net, optimizer=self.optimizer)
        self.manager = tf.train.CheckpointManager(self.checkpoint, str(config.checkpoint_dir), max_to_keep=3)

    def restore(self) -> int:
        """Resume from the latest checkpoint, if any; return the step it was at."""
        if self.manager.latest_checkpoint:
            self.checkpoint.restore(self.manager.latest_checkpoint).assert_existing_objects_matched()
        return int(self.step.numpy())

    @tf.function(reduce_retracing=True)
    def train_step(self, images, heat_target, box_target, box_weight, crops, crop_labels):
        lr = learning_rate(self.step, self.config)
        with tf.GradientTape() as tape:
            heat_logits, raw = self.net.locator(images, training=True)
            heat = heatmap_loss(heat_logits, heat_target)
            boxes = decode_boxes(box_distances(raw, self.net_config.box_scale), self.net_config)
            box = box_loss(boxes, box_target, box_weight)
            flat_crops = tf.reshape(crops, [-1, *crops.shape[2:]])
            classes = classifier_loss(self.net.classifier(flat_crops, training=True), tf.reshape(crop_labels, [-1]))
            loss = heat + BOX_LOSS_WEIGHT * box + classes
        grads = tape.gradient(loss, self.variables)
        grads, _ = tf.clip_by_global_norm(grads, 10.0)
        self.optimizer.apply(grads, lr)
        self.step.assign_add(1)
        return {"loss": loss, "heatmap_loss": heat, "box_loss": box, "classifier_loss": classes,
                "learning_rate": lr}

    def run(self, stream: Optional[TextIO] = None) -> int:
        """Train from the latest checkpoint to `config.steps`; return the step reached."""
        stream = stream if stream is not None else sys.stderr
        config = self.config
        start = self.restore()
        if start >= config.steps:
            print(f"already trained to step {start} (asked for {config.steps}); nothing to do", file=stream)
            return start
        if start:
            print(f"resuming from {self.manager.latest_checkpoint} at step {start}", file=stream)
        writer = tf.summary.create_file_writer(str(Path(config.logdir) / "train"))
        bar = ProgressBar(config.steps, "train", start=start, stream=stream)
        batches = iter(training_batches(self.net_config, config.seed, config.batch_size, start))
        step, window_started, window_images = start, time.perf_counter(), 0
        try:
            while step < config.steps:
                metrics = self.train_step(*next(batches))
                step = int(self.step.numpy())
                window_images += config.batch_size
                elapsed = time.perf_counter() - window_started
                throughput = window_images / elapsed if elapsed > 0 else 0.0
                values = {k: float(v) for k, v in metrics.items()}
                bar.update(step, loss=values["loss"], img_s=round(throughput, 1), lr=values["learning_rate"])
                if step % config.summary_every == 0 or step == config.steps:
                    _write_summaries(writer, step, values, throughput)
                    window_started, window_images = time.perf_counter(), 0
                if step % config.checkpoint_every == 0 or step == config.steps:
                    self.manager.save(checkpoint_number=step)
        except KeyboardInterrupt:
            self.manager.save(checkpoint_number=int(self.step.numpy()))
            print(f"\ninterrupted: saved step {int(self.step.numpy())}; run again to resume", file=stream)
            raise
        finally:
            writer.flush()
        return step


def _write_summaries(writer, step: int, values: dict, throughput: float) -> None:
    scalars = {**values, "images_per_second": throughput}
    for gpu in tensorflow_memory_info():
        if "error" not in gpu:
            device = gpu["device"].split(":", 1)[-1].replace(":", "_")
            scalars[f"memory/{device}/current_mib"] = gpu["current_mib"]
            scalars[f"memory/{device}/peak_mib"] = gpu["peak_mib"]
    with writer.as_default(step=step):
        for name, value in scalars.items():
            tf.summary.write(name, tf.constant(value, tf.float32), metadata=_SCALAR_METADATA)


def _net_config(checkpoint_dir: Path, wanted: NetConfig) -> NetConfig:
    """Return the network shape saved with existing checkpoints, else save and return `wanted`."""
    path = Path(checkpoint_dir) / CONFIG_FILE
    if path.exists():
        return NetConfig.from_json(json.loads(path.read_text()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted.to_json(), indent=2) + "\n")
    return wanted


def load_net(checkpoint_dir: Path) -> tuple[ShapesNet, int]:
    """Rebuild the network saved in `checkpoint_dir` from its latest checkpoint; return it and its step."""
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / CONFIG_FILE
    latest = tf.train.latest_checkpoint(str(checkpoint_dir))
    if not path.exists() or latest is None:
        raise FileNotFoundError(f"no trained shapes checkpoint in {checkpoint_dir}")
    net = ShapesNet(NetConfig.from_json(json.loads(path.read_text())))
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    tf.train.Checkpoint(step=step, net=net).restore(latest).expect_partial()
    return net, int(step.numpy())


def describe(config: TrainConfig) -> str:
    """One line naming the schedule, for the log."""
    fields = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    return "training " + " ".join(f"{k}={v}" for k, v in fields.items())

