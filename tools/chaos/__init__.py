"""The chaos soak: traffic on every protocol while faults land on a seeded schedule (`python -m tools.chaos`).

run.py starts the server and lands the faults, traffic.py is each client process, report.py checks the run.
"""
