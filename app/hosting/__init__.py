"""Twisted's side: the Site that admits and drains, the listening socket's close at shutdown, the lifecycle,
and the `serve` composition root."""
