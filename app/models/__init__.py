"""Models on disk, the registry that serves them, and the worker processes that run them.

repository (folders and versions), registry (states, budget, lifecycle: the data plane), workers (the
one owner of worker processes), channel (the wire to a worker), worker (what runs inside one).
"""
