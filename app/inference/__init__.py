"""Detection itself: decoding images, batching them, running a SavedModel, and turning outputs into boxes."""
