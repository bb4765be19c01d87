"""KServe v2 / Open Inference Protocol over gRPC: `inference.GRPCInferenceService`, as tritonclient.grpc drives it.

A thin servicer over the same data plane and protocol logic as /v2 (app/protocol/v2.py): a ModelInferRequest
becomes the same InferRequest the HTTP route parses, runs through the same `infer`, admission, queue and
batches, and its answer is the same tensors, written as raw_output_contents (as Triton writes them). Inputs come as
`raw_input_contents` (one entry per input, BYTES as 4-byte little-endian lengths and bytes) or typed
`contents`; every declared shape is checked against the data before anything is allocated from it.
Methods: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig, ModelInfer,
ModelStatistics, the system shared-memory extension (SystemSharedMemoryRegister, Status and Unregister),
ModelStreamInfer (each request answered on the stream, with its id; a failed one with its error_message, the
stream going on), and the repository extension (RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload);
the others answer UNIMPLEMENTED. Errors are raised as the project's own and answered by app/grpc/calls.py.
"""

from __future__ import annotations

import time

import numpy as np
from google.protobuf import json_format

from ..errors import InvalidBody
from ..protocol import context as request_context
from ..protocol import repository, v2
from ..protocol.plane import DataPlane
from ..protocol.v2_codec import (
    DATATYPES, MAX_NAME, NUMPY_TYPES, InferRequest, RequestedOutput, Tensor, binary_data, check_requested_output,
    check_shape, check_unique_inputs, element_count, shared_memory_ref, tensor_bytes,
)
from ..protocol.admission import Admission
from ..protocol.context import RequestContext
from ..timeline import Timeline
from .calls import deadline_of, observe_request, status_of
from .streams import Streams
from .protos import grpc_service_pb2 as pb
from .protos import grpc_service_pb2_grpc as pb_grpc
from .protos import model_config_pb2

STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"

# Where each datatype's elements go in InferTensorContents; FP16 has no field (send it raw).
CONTENTS_FIELDS = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """inference.GRPCInferenceService over the data plane; called in gRPC worker threads."""

    def __init__(self, plane: DataPlane, admission: Admission, streams: "Streams"):
        self._plane = plane
        self._admission = admission
        self._streams = streams

    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._plane.ready())

    def ModelReady(self, request, context):
        """Ready while the model is loaded; a version it does not serve is not ready (an unknown model: NOT_FOUND)."""
        return pb.ModelReadyResponse(ready=v2.model_ready(self._plane.model(request.name), request.version))

    def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**v2.server_metadata(self._plane))

    def ModelMetadata(self, request, context):
        _, described = self._described(request, context)
        return pb.ModelMetadataResponse(
            name=described["name"], versions=described["versions"], platform=described["platform"],
            inputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in described["inputs"]],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in described["outputs"]])

    def ModelConfig(self, request, context):
        """The model's configuration as Triton gives it (app/protocol/v2.py's model_config), as a ModelConfig."""
        model, described = self._described(request, context)
        config = v2.model_config(self._plane, model, described)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))

    def ModelInfer(self, request, context):
        plane = self._plane
        model = plane.model(request.model_name, request.model_version or None)
        parsed = infer_request(request)
        inferred = v2.infer(plane, model, parsed, lambda timeout_s: deadline_of(context, timeout_s),
                            self._admission.admit)
        return infer_response(inferred.model_name, inferred.version, inferred.request_id,
                              [tensor for tensor, _ in inferred.tensors])

    def ModelStreamInfer(self, request_iterator, context):
        """Answer each request on the stream on the stream, in the order they finish, each with its id.

        Requests run at once, as unary ModelInfer calls do (the same admission, deadline and batching), so a
        client with several in flight on one stream gets them batched. A request that fails is answered with
        its `error_message` and the stream goes on. A client that closes the stream stops it: what it had in
        flight finishes in the model, and its answers are dropped.
        """
        return self._streams.serve(request_iterator, context, self._stream_answer)

    def _stream_answer(self, request, context, stream: RequestContext):
        """One request of a stream, in a request context of its own (the stream's client and cancellation): its
        answer, or its error as Triton sends it."""
        parameters = {}
        final = request.parameters.get("triton_enable_empty_final_response")
        if final is not None and final.bool_param:
            parameters["triton_final_response"] = pb.InferParameter(bool_param=True)
        started, code = time.perf_counter(), "OK"
        try:
            response = self._observed(lambda: self.ModelInfer(request, context), stream)
        except Exception as error:
            code, message = status_of(error, "a ModelStreamInfer request")
            return pb.ModelStreamInferResponse(error_message=message, infer_response=pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version, id=request.id,
                parameters=parameters))
        finally:  # each request of a stream counts as a call of its own in detect_grpc_requests_total
            known = self._plane.find_model(request.model_name) is not None  # a label only for a model there is
            self._plane.metrics.observe_call(STREAM_METHOD, code, time.perf_counter() - started,
                                             request.model_name if known else "")
        for key, value in parameters.items():
            response.parameters[key].CopyFrom(value)
        return pb.ModelStreamInferResponse(infer_response=response)

    def _observed(self, call, stream: RequestContext):
        """Run `call` in a request context of its own, recording it as the interceptor records a unary call."""
        token = request_context.begin(Timeline(), stream.client, stream.cancellation)
        try:
            answer = call()
            observe_request(self._plane, answered=True)
            return answer
        except Exception:
            observe_request(self._plane, answered=False)
            raise
        finally:
            request_context.end(token)

    def ModelStatistics(self, request, context):
        """Triton's statistics of every model (no name) or of one, as the HTTP stats routes give them."""
        answer = v2.statistics(self._plane, request.name or None, request.version or None)
        return json_format.ParseDict(answer, pb.ModelStatisticsResponse())

    def SystemSharedMemoryRegister(self, request, context):
        self._plane.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    def SystemSharedMemoryStatus(self, request, context):
        regions = self._plane.shared_memory.status(request.name or None)
        return pb.SystemSharedMemoryStatusResponse(regions={
            region["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(**region) for region in regions})

    def SystemSharedMemoryUnregister(self, request, context):
        self._plane.shared_memory.unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    def RepositoryIndex(self, request, context):
        rows = repository.index_rows(self._plane, request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**row) for row in rows])

    def RepositoryModelLoad(self, request, context):
        repository.load(self._plane, request.model_name, request.parameters)
        return pb.RepositoryModelLoadResponse()

    def RepositoryModelUnload(self, request, context):
        repository.unload(self._plane, request.model_name)
        return pb.RepositoryModelUnloadResponse()

    def _described(self, request, context) -> tuple[object, dict]:
        """The model a ModelMetadata or ModelConfig request names, and its metadata."""
        plane = self._plane
        model = plane.model(request.name, request.version or None)
        return model, v2.model_metadata(plane, model, deadline_of(context, plane.settings.request_deadline_s))


# Reading requests and writing answers --------------------------------------------------------------------


def infer_request(request) -> InferRequest:
    """Read a ModelInferRequest as the HTTP route's parser reads a body; raise BadRequest naming what is wrong."""
    if not request.inputs:
        raise InvalidBody("the request has no inputs")
    raw = list(request.raw_input_contents)
    placed = [shared_memory_ref(parameter_values(t.parameters, f"input {t.name[:40]!r}"), f"input {t.name[:40]!r}")
              for t in request.inputs]
    carried = sum(1 for ref in placed if ref is None)  # the inputs whose data is in the message
    if raw and len(raw) != carried:
        raise InvalidBody(f"raw_input_contents holds {len(raw)} entries for {carried} inputs; give one per input "
                          "not in shared memory, in the inputs' order, or none")
    inputs = []
    for i, tensor in enumerate(request.inputs):
        name = _name(tensor.name, f"input {i}")
        where = f"input {name!r}"
        if tensor.datatype not in DATATYPES:
            raise InvalidBody(f"{where} has datatype {tensor.datatype[:20]!r}; the datatypes are {', '.join(DATATYPES)}")
        shape = check_shape(list(tensor.shape), where)
        if placed[i] is not None:
            if tensor.HasField("contents"):
                raise InvalidBody(f"{where} names a shared-memory region and also carries contents; send one")
            inputs.append(Tensor(name, tensor.datatype, shape, None, binary=True, shared_memory=placed[i]))
            continue
        if raw:
            if tensor.HasField("contents"):
                raise InvalidBody(f"{where} has both contents and raw_input_contents; send one")
            data = binary_data(memoryview(raw.pop(0)), tensor.datatype, shape, where)
        elif tensor.HasField("contents"):
            data = typed_contents(tensor.contents, tensor.datatype, shape, where)
        else:
            raise InvalidBody(f"{where} has no data: neither contents nor raw_input_contents")
        inputs.append(Tensor(name, tensor.datatype, shape, data, binary=True))
    check_unique_inputs(inputs)
    outputs, seen = [], set()
    for i, output in enumerate(request.outputs):
        name = _name(output.name, f"output {i}")
        ref = check_requested_output(name, parameter_values(output.parameters, f"output {name!r}"), seen)
        outputs.append(RequestedOutput(name, True, ref))
    parameters = parameter_values(request.parameters, "the request")
    parameters.pop("binary_data_output", None)  # gRPC answers are always raw
    return InferRequest(request.id or None, tuple(inputs), tuple(outputs) or None, True, parameters)


def _name(name: str, where: str) -> str:
    if not name or len(name) > MAX_NAME:
        raise InvalidBody(f"{where} needs a name: a non-empty string of at most {MAX_NAME} characters")
    return name


def parameter_values(parameters, where: str) -> dict:
    """The request's InferParameter map as plain values, as the HTTP route's JSON gives them."""
    values = {}
    for key, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if kind is None:
            raise InvalidBody(f"parameter {key[:40]!r} of {where} has no value")
        values[key] = getattr(parameter, kind)
    return values


def typed_contents(contents, datatype: str, shape: tuple[int, ...], where: str):
    """Read a tensor's typed contents: exactly the shape's element count, each value within its datatype."""
    field = CONTENTS_FIELDS.get(datatype)
    if field is None:
        raise InvalidBody(f"{where} is {datatype}, which has no contents field: send it in raw_input_contents")
    others = [f.name for f, _ in contents.ListFields() if f.name != field]
    if others:
        raise InvalidBody(f"{where} is {datatype} but its contents fill {others[0]}; {datatype} goes in {field}")
    values = getattr(contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise InvalidBody(f"{where} has shape {list(shape)} ({count} elements) but its contents hold {len(values)}")
    if datatype == "BYTES":
        return list(values)
    target = np.dtype(NUMPY_TYPES[datatype])
    array = np.asarray(values)
    if target.kind in "iu" and array.size:
        info = np.iinfo(target)
        if int(array.min()) < info.min or int(array.max()) > info.max:
            raise InvalidBody(f"{where} is {datatype}: its values must be from {info.min} to {info.max}")
    return array.astype(target).reshape(shape)


def infer_response(model_name: str, version, request_id, tensors: list[Tensor]):
    """Write the answer, every output's data in raw_output_contents in the outputs' order, as Triton does; an
    output written into shared memory names its region and holds an empty entry there, keeping the order."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=version or "", id=request_id or "")
    for tensor in tensors:
        output = response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=list(tensor.shape))
        if tensor.shared_memory is not None:
            output.parameters["shared_memory_region"].string_param = tensor.shared_memory.region
            output.parameters["shared_memory_byte_size"].int64_param = tensor.shared_memory.byte_size
            response.raw_output_contents.append(b"")
        else:
            response.raw_output_contents.append(tensor_bytes(tensor))
    return response
