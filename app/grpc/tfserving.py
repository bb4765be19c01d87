"""TF Serving's gRPC API: `tensorflow.serving.PredictionService` (Predict, GetModelMetadata) and
`tensorflow.serving.ModelService` (GetModelStatus), as TF Serving's PredictionServiceStub calls them.

A thin servicer over the same data plane and protocol logic as /v1 (app/protocol/v1.py): Predict takes the
signature's one input as a TensorProto, uint8 (or, for a float_image_tensor model, float) pixels [N, H, W, 3], or DT_STRING [N]
encoded image files (what an encoded_image_string_tensor export takes; any model accepts them, decoded by the
server as /detect decodes), and answers the signature's four outputs as DT_FLOAT tensors, or those
output_filter names. The messages are TF Serving's own, generated without TensorFlow (app/grpc/protos).
Errors are raised as the project's own and answered by app/grpc/calls.py. Classify, Regress,
MultiInference and HandleReloadConfigRequest answer UNIMPLEMENTED.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from google.protobuf import json_format

from ..errors import InvalidBody
from ..protocol import v1
from ..protocol.plane import DataPlane, served_version
from ..protocol.v1_codec import SIGNATURE, check_signature_name
from ..protocol.v2_codec import MAX_RANK
from ..protocol.admission import Admission
from .calls import deadline_of
from .protos.tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
from .protos.tensorflow_serving.apis import (
    get_model_metadata_pb2, get_model_status_pb2, model_pb2, model_service_pb2_grpc, predict_pb2,
    prediction_service_pb2_grpc,
)

# The pixel types a request may send, with the TensorProto field that holds them when tensor_content is empty.
PIXEL_TYPES = {types_pb2.DT_UINT8: (np.uint8, "int_val"), types_pb2.DT_FLOAT: (np.float32, "float_val")}
SIGNATURE_DEF = "signature_def"


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    """Predict and GetModelMetadata over the data plane; called in gRPC worker threads."""

    def __init__(self, plane: DataPlane, admission: Admission):
        self._plane = plane
        self._admission = admission

    def Predict(self, request, context):
        plane = self._plane
        spec = request.model_spec
        model = plane.model(spec.name, _version(spec))
        check_signature_name(spec.signature_name)
        deadline = deadline_of(context, plane.settings.request_deadline_s)
        wanted = []

        def read_images(signature: dict):
            declared = signature["input"]["name"]
            given = sorted(request.inputs)
            if given != [declared]:
                raise InvalidBody(f"the request's inputs are {', '.join(repr(n[:40]) for n in given[:5]) or 'none'}; "
                                  f"the signature has one input, {declared!r}")
            names = [out["name"] for out in signature["outputs"]]
            wanted.extend(_output_filter(list(request.output_filter), names))
            return _images(plane, request.inputs[declared], model, signature, f"input {declared!r}")

        run, arrays, _ = v1.predict(plane, model, deadline, read_images, self._admission.admit)
        response = predict_pb2.PredictResponse(model_spec=_spec(model.name, run.version))
        for name in wanted:
            response.outputs[name].CopyFrom(float_tensor(arrays[name]))
        return response

    def GetModelMetadata(self, request, context):
        plane = self._plane
        spec = request.model_spec
        model = plane.model(spec.name, _version(spec))
        fields = list(request.metadata_field)
        if fields != [SIGNATURE_DEF]:
            raise InvalidBody(f"metadata_field must be [{SIGNATURE_DEF!r}], the one metadata this server has, not "
                              f"{[f[:40] for f in fields[:5]]}")
        plane.signature_of(model, deadline_of(context, plane.settings.request_deadline_s))
        signatures = get_model_metadata_pb2.SignatureDefMap()
        json_format.ParseDict({"signature_def": model.signature_defs or {}}, signatures, ignore_unknown_fields=True)
        response = get_model_metadata_pb2.GetModelMetadataResponse(model_spec=_spec(model.name, served_version(model)))
        response.metadata[SIGNATURE_DEF].Pack(signatures)
        return response


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    """GetModelStatus: each version loading, served or failed, as TF Serving lists them."""

    def __init__(self, plane: DataPlane):
        self._plane = plane

    def GetModelStatus(self, request, context):
        spec = request.model_spec
        self._plane.models.get(spec.name)  # NOT_FOUND for an unknown name, before the spec's version is read
        version = _version(spec)
        statuses = v1.model_statuses(self._plane, spec.name, version, version)
        State = get_model_status_pb2.ModelVersionStatus.State
        return get_model_status_pb2.GetModelStatusResponse(model_version_status=[
            get_model_status_pb2.ModelVersionStatus(
                version=int(s["version"]), state=State.Value(s["state"]),
                status={"error_code": 0 if s["status"]["error_code"] == "OK" else 2,  # tensorflow.error.Code UNKNOWN
                        "error_message": s["status"]["error_message"]})
            for s in statuses])


# Reading requests and writing answers -----------------------------------------------------------------


def _version(spec) -> Optional[str]:
    if spec.version_label:
        raise InvalidBody(f"version labels are not supported (asked for {spec.version_label[:40]!r}); name a version "
                          "number or none")
    return str(spec.version.value) if spec.HasField("version") else None


def _spec(name: str, version: Optional[str]):
    spec = model_pb2.ModelSpec(name=name, signature_name=SIGNATURE)
    if version is not None and version.isdigit():
        spec.version.value = int(version)
    return spec


def _output_filter(wanted: list[str], names: list[str]) -> list[str]:
    if not wanted:
        return names
    for name in wanted:
        if name not in names:
            raise InvalidBody(f"output tensor alias {name[:60]!r} not found in signature; its outputs are "
                              f"{', '.join(names)}")
    duplicate = next((n for n in wanted if wanted.count(n) > 1), None)
    if duplicate is not None:
        raise InvalidBody(f"duplicate output {duplicate!r} in output_filter")
    return wanted


def _shape(proto, where: str) -> list[int]:
    if proto.tensor_shape.unknown_rank:
        raise InvalidBody(f"{where} has an unknown rank; give its shape")
    dims = [d.size for d in proto.tensor_shape.dim]
    if len(dims) > MAX_RANK or any(d < 0 for d in dims):
        raise InvalidBody(f"{where}: the shape must have at most {MAX_RANK} dimensions, none negative, not {dims[:10]}")
    return dims


def _images(plane: DataPlane, proto, model, signature: dict, where: str):
    """Check the input tensor against the model and the limits; return what decodes its images (after admission)."""
    dims = _shape(proto, where)
    count = math.prod(dims)
    if proto.dtype == types_pb2.DT_STRING:
        if len(dims) != 1:
            raise InvalidBody(f"{where} is DT_STRING: it must have shape [N], one encoded image file per element")
        blobs = list(proto.string_val)
        if len(blobs) != count:
            raise InvalidBody(f"{where} has shape {dims} but holds {len(blobs)} strings")
        plane.check_image_count(len(blobs), where)
        return lambda: plane.decode_files(blobs, model)
    allowed = (types_pb2.DT_UINT8, types_pb2.DT_FLOAT) if signature["input"]["dtype"] == "float32" \
        else (types_pb2.DT_UINT8,)
    if proto.dtype not in allowed:
        raise InvalidBody(f"{where} has dtype {_dtype_name(proto.dtype)}; the model takes {' or '.join(types_pb2.DataType.Name(d) for d in allowed)} pixels, or "
                          "DT_STRING encoded images")
    numpy_type, field = PIXEL_TYPES[proto.dtype]
    if len(dims) != 4:
        raise InvalidBody(f"{where} must have shape [N, height, width, 3], not {dims}")
    if proto.tensor_content:
        size = count * np.dtype(numpy_type).itemsize
        if size != len(proto.tensor_content):
            raise InvalidBody(f"{where} has shape {dims}: {size} bytes, but tensor_content holds "
                              f"{len(proto.tensor_content)}")
        batch = np.frombuffer(proto.tensor_content, dtype=numpy_type).reshape(dims)
    else:
        values = getattr(proto, field)
        if len(values) != count:
            raise InvalidBody(f"{where} has shape {dims} ({count} elements) but {field} holds {len(values)}")
        batch = np.asarray(values).reshape(dims)
    images = plane.tensor_images(batch, signature, where)
    return lambda: images


def _dtype_name(dtype: int) -> str:
    return types_pb2.DataType.Name(dtype) if dtype in types_pb2.DataType.values() else str(dtype)


def float_tensor(array: np.ndarray):
    """A DT_FLOAT TensorProto holding `array`, its data in tensor_content as tf.make_tensor_proto writes it."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    return tensor_pb2.TensorProto(
        dtype=types_pb2.DT_FLOAT, tensor_content=array.tobytes(),
        tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d)
                                                             for d in array.shape]))
