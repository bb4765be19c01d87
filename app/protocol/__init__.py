"""The protocol-neutral floor under both front doors: the data plane, the protocols' logic and codecs, the
request's context.

`plane.DataPlane` finds models and runs images; `v2` (KServe v2) and `v1` (TF Serving) hold each protocol's
logic once, over the codecs `v2_codec`, `v1_codec` and `bodies`; `repository` is Triton's model-repository
extension; `context` holds the request's model and Timeline. app/http and app/grpc import from here and never
from each other; nothing here imports Flask, Werkzeug, grpc or the front doors.
"""
