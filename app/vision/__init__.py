"""Vision beside detection: drawing answers on pictures, decoding video, tracking objects across frames.

Sits beside app/inference in the layers and imports neither Flask nor Twisted: `annotate` draws boxes
and encodes the picture, `video` opens, checks and decodes video files with PyAV (the `video` extra)
and encodes annotated ones, `tracking` is ByteTrack, one tracker per video request.
"""
