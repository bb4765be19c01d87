"""A GPU-sharing object-detection service: Flask on Twisted, with a GPU memory policy applied at boot."""
