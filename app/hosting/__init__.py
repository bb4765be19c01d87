"""Twisted's side: the Site that admits and drains, the lifecycle, and the `serve` composition root."""
