"""The "shapes" detector: synthetic data, a compact CenterNet-style network, training, export, evaluation."""

from .data import CLASSES

__all__ = ["CLASSES"]
