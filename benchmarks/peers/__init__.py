"""The peer comparison: this service beside Ray Serve, KServe and MLServer (`python -m benchmarks.peers.compare`).

compare.py runs it, systems.py starts each system, proctree.py samples and stops their process trees, and
common.py is the model work every peer's server file (ray/, kserve/, mlserver/) does in its own venv.
"""
