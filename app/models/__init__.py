"""Models on disk, the registry that serves them, and the worker processes that run them.

repository (folders and versions), versions (which version of a model to load), served (one model's
lifecycle: its queue, state and worker, from load to unload), registry (the models, the GPU budget they
share and the spare workers: the data plane), host (the seam between those two: the lock they share and
what each may call), workers (the one owner of worker processes), channel (the wire to a worker), worker
(what runs inside one), history (memory over time).
"""
