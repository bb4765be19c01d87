"""The GPU check: the service's GPU claims against a real GPU (`python -m tools.gpu_check`, scripts/gpu-check).

checks.py runs the checks; holder.py is each child process that holds GPU memory. Both import only the
standard library, pynvml and the stdlib-only modules of `app` that checks.py names.
"""
