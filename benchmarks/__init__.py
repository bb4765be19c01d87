"""Benchmarks against the service: the peer comparison (peers/), the service's overhead, the spare worker."""
