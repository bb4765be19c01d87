"""KServe v2 / Open Inference Protocol inference requests and responses, with Triton's binary tensor extension.

Pure functions over bytes and numpy arrays, no Flask: `parse_infer_request` reads a request body (a JSON
header, then the binary data of the inputs that carry `binary_data_size`, in input order, when the
`Inference-Header-Content-Length` header is given), and `write_infer_response` writes the answer the same
way. BYTES tensors are, in binary, each element's 4-byte little-endian length and then its bytes; in JSON, a
list of strings.

Everything a client declares is checked against what it sent before anything is allocated from it: the
header length against the body, every dimension (an integer of at least 1), the element count against
the bytes that could hold it, `binary_data_size` against the shape and datatype, every BYTES length prefix
against the bytes left. A JSON header nested deeper than Python's parser goes is refused, never a crash.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..errors import BadRequest, InvalidBody
from .bodies import json_object

# The datatypes of the protocol and their numpy types; BYTES has none (a list of bytes).
NUMPY_TYPES = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}
DATATYPES = (*NUMPY_TYPES, "BYTES")
MAX_RANK = 8
MAX_NAME = 256
HEADER_LENGTH = "Inference-Header-Content-Length"

TensorData = Union[np.ndarray, list]  # numeric: an array of the shape; BYTES: a flat list of bytes


@dataclass(frozen=True)
class SharedMemoryRef:
    """Where a tensor lies in a registered shared-memory region (app/protocol/shared_memory.py)."""

    region: str
    byte_size: int
    offset: int = 0

    def parameters(self) -> dict:
        """The parameters an answer names the region with, as Triton writes them."""
        return {"shared_memory_region": self.region, "shared_memory_byte_size": self.byte_size}


@dataclass(frozen=True)
class Tensor:
    """One input or output tensor: name, datatype, shape, and its data (BYTES: a flat list of bytes).

    A tensor in shared memory has no data here: `shared_memory` says where it lies."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Optional[TensorData]
    binary: bool = False  # it came as binary data (else as JSON)
    shared_memory: Optional[SharedMemoryRef] = None


@dataclass(frozen=True)
class RequestedOutput:
    """An output the request asks for, and whether it wants it as binary data (None: the request's default), or
    written into a shared-memory region."""

    name: str
    binary: Optional[bool]
    shared_memory: Optional[SharedMemoryRef] = None


@dataclass(frozen=True)
class InferRequest:
    """A parsed inference request. `raw` holds the whole body of a request whose header length is 0."""

    id: Optional[str]
    inputs: tuple[Tensor, ...]
    outputs: Optional[tuple[RequestedOutput, ...]]  # None: every output
    binary_output: bool  # the request's binary_data_output (or a raw request): outputs' default
    parameters: dict
    raw: Optional[bytes] = None
    model_name: Optional[str] = None  # as the body names it (KServe's SDK sends it); the URL's must agree
    model_version: Optional[str] = None


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


def parse_infer_request(body: bytes, header_length: Optional[str]) -> InferRequest:
    """Parse an inference request body; raise BadRequest naming what is wrong."""
    length = _header_length(header_length, len(body))
    if length == 0:
        # Triton's raw binary request: the whole body is the data of the model's one input.
        return InferRequest(id=None, inputs=(), outputs=None, binary_output=True, parameters={}, raw=body)
    head = body if length is None else body[:length]
    binary = b"" if length is None else memoryview(body)[length:]
    document = json_object(bytes(head), "the JSON inference header")
    _only_keys(document, ("id", "model_name", "model_version", "parameters", "inputs", "outputs"), "the request")
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidBody("'id' must be a string")
    for key in ("model_name", "model_version"):
        if document.get(key) is not None and not isinstance(document[key], str):
            raise InvalidBody(f"'{key}' must be a string")
    parameters = _parameters(document.get("parameters"), "the request")
    binary_output = parameters.pop("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise InvalidBody("the parameter 'binary_data_output' must be true or false")
    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidBody("'inputs' must be a non-empty list of tensors")
    inputs, offset = [], 0
    for i, raw in enumerate(raw_inputs):
        tensor, used = _input(raw, i, binary[offset:] if length is not None else None)
        inputs.append(tensor)
        offset += used
    if length is not None and offset != len(binary):
        raise InvalidBody(f"the body has {len(binary) - offset} bytes of binary data that no input claims "
                          f"(the inputs' binary_data_size add up to {offset}, and {len(binary)} follow the header)")
    check_unique_inputs(inputs)
    outputs = _requested_outputs(document.get("outputs"))
    return InferRequest(request_id, tuple(inputs), outputs, binary_output, parameters,
                        model_name=document.get("model_name"), model_version=document.get("model_version") or None)


def _header_length(value: Optional[str], body_length: int) -> Optional[int]:
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 12):
        raise InvalidBody(f"{HEADER_LENGTH} must be a non-negative integer, not {value[:40]!r}")
    length = int(text)
    if length > body_length:
        raise InvalidBody(f"{HEADER_LENGTH} is {length}, beyond the body's {body_length} bytes")
    return length


def _only_keys(document: dict, allowed: Sequence[str], where: str) -> None:
    unknown = sorted(set(document) - set(allowed))
    if unknown:
        raise InvalidBody(f"{where} has an unknown field {unknown[0][:40]!r}; it takes {', '.join(allowed)}")


def _parameters(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidBody(f"'parameters' of {where} must be a JSON object")
    for key, item in value.items():
        if not isinstance(item, (bool, int, float, str)):
            raise InvalidBody(f"parameter {key[:40]!r} of {where} must be a boolean, number or string")
    return dict(value)


def _name(raw: dict, where: str) -> str:
    name = raw.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise InvalidBody(f"{where} needs a 'name': a non-empty string of at most {MAX_NAME} characters")
    return name


def _input(raw, index: int, binary: Optional[memoryview]) -> tuple[Tensor, int]:
    """Parse one input; return it and how many bytes of binary data it took."""
    where = f"input {index}"
    if not isinstance(raw, dict):
        raise InvalidBody(f"{where} must be a JSON object")
    name = _name(raw, where)
    where = f"input {name!r}"
    _only_keys(raw, ("name", "shape", "datatype", "parameters", "data"), where)
    datatype = raw.get("datatype")
    if datatype not in DATATYPES:
        raise InvalidBody(f"{where} has datatype {str(datatype)[:20]!r}; the datatypes are {', '.join(DATATYPES)}")
    shape = check_shape(raw.get("shape"), where)
    parameters = _parameters(raw.get("parameters"), where)
    placed = shared_memory_ref(parameters, where)
    if placed is not None:
        if "data" in raw or "binary_data_size" in parameters:
            raise InvalidBody(f"{where} names a shared-memory region and also carries data; send one")
        return Tensor(name, datatype, shape, None, binary=True, shared_memory=placed), 0
    size = parameters.pop("binary_data_size", None)
    if size is None:
        if "data" not in raw:
            raise InvalidBody(f"{where} has neither 'data' nor binary data (parameters.binary_data_size)")
        return Tensor(name, datatype, shape, _json_data(raw["data"], datatype, shape, where)), 0
    if "data" in raw:
        raise InvalidBody(f"{where} has both 'data' and binary data; send one")
    if binary is None:
        raise InvalidBody(f"{where} has binary_data_size but the request has no {HEADER_LENGTH} header")
    if type(size) is not int or size < 0:
        raise InvalidBody(f"{where}: binary_data_size must be a non-negative integer")
    if size > len(binary):
        raise InvalidBody(f"{where}: binary_data_size is {size}, beyond the {len(binary)} bytes left in the body")
    return Tensor(name, datatype, shape, binary_data(binary[:size], datatype, shape, where), binary=True), size


def check_shape(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_RANK:
        raise InvalidBody(f"{where}: 'shape' must be a list of 1 to {MAX_RANK} dimensions")
    for dim in value:
        if type(dim) is not int or dim < 1:
            raise InvalidBody(f"{where}: every dimension must be an integer of at least 1, not {str(dim)[:30]}")
    return tuple(value)


def check_binary_size(size: int, datatype: str, shape: tuple[int, ...], where: str = "the tensor",
                      size_name: str = "binary_data_size") -> None:
    """Refuse binary data of `size` bytes (the request's `size_name`) that the datatype and shape cannot be, before
    a byte of it is read: fixed-size elements take exactly count x itemsize; BYTES elements at least their 4-byte
    length prefixes."""
    count = element_count(shape)
    if datatype == "BYTES":
        if count * 4 > size:
            raise InvalidBody(f"{where} declares {count} BYTES elements, more than {size} bytes can hold")
        return
    itemsize = np.dtype(NUMPY_TYPES[datatype]).itemsize
    if count * itemsize != size:
        raise InvalidBody(f"{where} is {datatype} of shape {list(shape)}: {count * itemsize} bytes, but "
                          f"{size_name} is {size}")


def binary_data(data: memoryview, datatype: str, shape: tuple[int, ...], where: str = "the tensor") -> TensorData:
    """Read a tensor's binary data: fixed-size elements, or BYTES as 4-byte little-endian lengths and bytes."""
    check_binary_size(len(data), datatype, shape, where)
    if datatype == "BYTES":
        return _bytes_elements(data, element_count(shape), where)
    return np.frombuffer(data, dtype=NUMPY_TYPES[datatype]).reshape(shape)


def _bytes_elements(data: memoryview, count: int, where: str) -> list[bytes]:
    elements, offset = [], 0
    for i in range(count):
        if offset + 4 > len(data):
            raise InvalidBody(f"{where}: BYTES element {i} has no length prefix; the data ends at byte {offset}")
        (size,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if offset + size > len(data):
            raise InvalidBody(f"{where}: BYTES element {i} has a length of {size}, past the end of the data")
        elements.append(bytes(data[offset:offset + size]))
        offset += size
    if offset != len(data):
        raise InvalidBody(f"{where}: {len(data) - offset} bytes follow its {count} BYTES elements")
    return elements


def _json_data(data, datatype: str, shape: tuple[int, ...], where: str) -> TensorData:
    """Read JSON `data`, flat in row-major order or nested as the shape; check its count and types."""
    count = element_count(shape)
    if not isinstance(data, list):
        raise InvalidBody(f"{where}: 'data' must be a list")
    if datatype == "BYTES":
        flat = _flatten(data, len(shape), where)
        if len(flat) != count:
            raise InvalidBody(f"{where} has shape {list(shape)} ({count} elements) but 'data' holds {len(flat)}")
        if not all(isinstance(item, str) for item in flat):
            raise InvalidBody(f"{where}: BYTES data in JSON must be strings")
        return [item.encode("utf-8", "surrogatepass") for item in flat]
    try:
        # 64-bit integers past int64 would become floats and lose digits: keep them Python ints.
        wide = datatype in ("UINT64", "INT64")
        array = np.asarray(data, dtype=object) if wide else np.asarray(data)
        if wide and not all(type(v) is int for v in array.flat):  # _typed checks the range
            array = np.asarray(data)
    except (ValueError, TypeError):
        raise InvalidBody(f"{where}: 'data' is not a list of numbers nested as its shape {list(shape)}") from None
    if array.size != count or (array.ndim != 1 and array.shape != shape):
        raise InvalidBody(f"{where} has shape {list(shape)} ({count} elements) but 'data' holds "
                          f"{array.size} in shape {list(array.shape)}")
    return _typed(array, datatype, where).reshape(shape)


def _flatten(data: list, depth: int, where: str) -> list:
    """Flatten nested lists at most `depth` deep (the rank), iteratively."""
    flat, stack = [], [(data, 1)]
    while stack:
        items, level = stack.pop()
        for item in reversed(items):
            if isinstance(item, list):
                if level >= depth:
                    raise InvalidBody(f"{where}: 'data' is nested deeper than its shape")
                stack.append((item, level + 1))
            else:
                flat.append(item)
    flat.reverse()
    return flat


def _typed(array: np.ndarray, datatype: str, where: str) -> np.ndarray:
    """Convert JSON numbers to the datatype, refusing what does not fit it (no silent wrap or rounding)."""
    kind = array.dtype.kind
    target = np.dtype(NUMPY_TYPES[datatype])
    if datatype == "BOOL":
        if kind != "b":
            raise InvalidBody(f"{where} is BOOL: 'data' must hold true and false")
        return array
    if target.kind in "iu":
        info = np.iinfo(target)
        if kind == "O" and all(type(v) is int for v in array.flat):  # integers past int64, as UINT64 allows
            if any(v < info.min or v > info.max for v in array.flat):
                raise InvalidBody(f"{where} is {datatype}: its values must be from {info.min} to {info.max}")
            return array.astype(target)
        if kind not in "iu":
            raise InvalidBody(f"{where} is {datatype}: 'data' must hold integers")
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise InvalidBody(f"{where} is {datatype}: its values must be from {info.min} to {info.max}")
        return array.astype(target)
    if kind not in "iuf":
        raise InvalidBody(f"{where} is {datatype}: 'data' must hold numbers")
    return array.astype(target)


def check_unique_inputs(inputs: Sequence[Tensor]) -> None:
    """Refuse a request that names an input twice (every transport of the protocol)."""
    names = [t.name for t in inputs]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise InvalidBody(f"duplicate input name {duplicate!r} is not allowed in a request")


def shared_memory_ref(parameters: dict, where: str) -> Optional[SharedMemoryRef]:
    """Read where a tensor lies in shared memory (shared_memory_region, _byte_size, _offset), or None if it does
    not name a region."""
    keys = [key for key in parameters if key.startswith("shared_memory")]
    if not keys:
        return None
    unknown = sorted(set(keys) - {"shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"})
    if unknown:
        raise InvalidBody(f"{where} has an unknown parameter {unknown[0][:40]!r}; a shared-memory tensor takes "
                          "shared_memory_region, shared_memory_byte_size and shared_memory_offset")
    region = parameters.get("shared_memory_region")
    if not isinstance(region, str) or not region:
        raise InvalidBody(f"{where}: shared_memory_region must name a registered region")
    byte_size = _whole(parameters.get("shared_memory_byte_size"), f"{where}: shared_memory_byte_size")
    offset = _whole(parameters.get("shared_memory_offset", 0), f"{where}: shared_memory_offset")
    return SharedMemoryRef(region, byte_size, offset)


def _whole(value, what: str) -> int:
    if isinstance(value, bool) or type(value) is not int or value < 0:
        raise InvalidBody(f"{what} must be a whole number of bytes, not {value!r:.40}")
    return value


def check_requested_output(name: str, parameters: dict, seen: set) -> Optional[SharedMemoryRef]:
    """Check one requested output: named once (`seen` holds the names so far), no classification; return the
    shared-memory region it is to be written into, if it names one."""
    where = f"output {name!r}"
    if name in seen:
        raise InvalidBody(f"duplicate output name {name!r} is not allowed in a request")
    seen.add(name)
    if "classification" in parameters:
        raise BadRequest(f"{where} asks for classification; the classification extension is not implemented")
    return shared_memory_ref(parameters, where)


def _requested_outputs(value) -> Optional[tuple[RequestedOutput, ...]]:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidBody("'outputs' must be a list")
    outputs, seen = [], set()
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise InvalidBody(f"output {i} must be a JSON object")
        name = _name(raw, f"output {i}")
        where = f"output {name!r}"
        _only_keys(raw, ("name", "parameters"), where)
        parameters = _parameters(raw.get("parameters"), where)
        placed = check_requested_output(name, parameters, seen)
        binary = parameters.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise InvalidBody(f"{where}: binary_data must be true or false")
        outputs.append(RequestedOutput(name, binary, placed))
    return tuple(outputs)


# Writing ---------------------------------------------------------------------------------------------------


def tensor_bytes(tensor: Tensor) -> bytes:
    """A tensor's data as the binary extension writes it (and as it goes into a shared-memory region)."""
    if tensor.datatype == "BYTES":
        return serialize_bytes(tensor.data)
    return np.ascontiguousarray(tensor.data, dtype=NUMPY_TYPES[tensor.datatype]).tobytes()


def serialize_bytes(elements: Sequence[bytes]) -> bytes:
    """Write BYTES elements as the binary extension has them: a 4-byte little-endian length, then the bytes."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def write_infer_response(model_name: str, model_version: Optional[str], request_id: Optional[str],
                         outputs: Sequence[tuple[Tensor, bool]],
                         parameters: Optional[dict] = None) -> tuple[bytes, Optional[int]]:
    """Write the response: return the body and, when some output is binary, the JSON header's length."""
    document: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        document["model_version"] = model_version
    if request_id is not None:
        document["id"] = request_id
    if parameters:
        document["parameters"] = parameters
    entries, blobs = [], []
    for tensor, binary in outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if tensor.shared_memory is not None:  # written into the client's region already (app/protocol/v2.py)
            # Triton's C++ client reads binary_data_size wherever an output has parameters: none of it follows.
            entry["parameters"] = {**tensor.shared_memory.parameters(), "binary_data_size": 0}
        elif binary:
            blob = tensor_bytes(tensor)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif tensor.datatype == "BYTES":
            entry["data"] = [e.decode("utf-8", "replace") for e in tensor.data]
        else:
            entry["data"] = np.asarray(tensor.data).ravel().tolist()
        entries.append(entry)
    document["outputs"] = entries
    head = json.dumps(document, separators=(",", ":")).encode()
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)
