"""A v2 inference request's tensors that lie in shared memory: its inputs read from registered regions, its
outputs written into them (Triton's system shared-memory extension; the regions' owner is shared_memory.py).

The order is the point: nothing is read before it is known to be allowed and to fit, and nothing is written
before every output is known to fit.

1. `hold`, before the request is admitted to its model: the client may use shared memory at all (the
   shared-memory group's rule, DataPlane.shared_memory_region), every region it names is registered (and held
   until the answer is written), every span lies inside its region, and each input's declared size is what its
   datatype and shape take, all of them together within max_body_bytes, the limit of a request's body: a
   region costs its client nothing to name, so what it makes the server read is bounded as a body is.
2. `check_output_rooms`, before the model runs: each output whose size the signature fixes fits its place.
3. `read_inputs`, once admitted: each input read from its region.
4. `write_outputs`, after the model ran: every output checked against its place first (the sizes the
   signature left open, and `detections`, are known only now), then all of them written, so that a request
   refused for one output has written none.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Optional

from ..errors import BodyTooLarge, InvalidBody
from .plane import DataPlane
from .shared_memory import Region
from .v2_codec import InferRequest, SharedMemoryRef, Tensor, binary_data, check_binary_size, tensor_bytes

FP32_BYTES = 4  # every model output goes out as FP32 (app/protocol/v2.py)


@dataclass
class Placed:
    """The regions a request's tensors lie in: each input's and each output's region and place."""

    inputs: dict[str, tuple[Region, SharedMemoryRef]] = field(default_factory=dict)
    outputs: dict[str, tuple[Region, SharedMemoryRef]] = field(default_factory=dict)


def hold(plane: DataPlane, parsed: InferRequest, regions: ExitStack) -> Placed:
    """Check and hold (on `regions`, until the answer is written) every region the request names; read nothing."""
    placed = Placed()
    total = 0
    for tensor in parsed.inputs:
        ref = tensor.shared_memory
        if ref is None:
            continue
        where = f"input {tensor.name!r}"
        region = regions.enter_context(plane.shared_memory_region(ref.region, where))
        region.check_span(ref.offset, ref.byte_size, where)
        check_binary_size(ref.byte_size, tensor.datatype, tensor.shape, where, "shared_memory_byte_size")
        total += ref.byte_size
        placed.inputs[tensor.name] = (region, ref)
    limit = plane.settings.max_body_bytes
    if total > limit:
        raise BodyTooLarge(f"the request's shared-memory inputs are {total} bytes, over the limit of {limit} bytes "
                           "(max_body_bytes) a request may bring in, whichever way")
    for output in parsed.outputs or ():
        ref = output.shared_memory
        if ref is not None:
            where = f"output {output.name!r}"
            region = regions.enter_context(plane.shared_memory_region(ref.region, where))
            region.check_span(ref.offset, ref.byte_size, where)
            placed.outputs[output.name] = (region, ref)
    return placed


def check_output_rooms(placed: Placed, signature: dict, images: int) -> None:
    """Refuse, before the model runs, an output whose size the signature fixes and its place cannot take."""
    for out in signature["outputs"]:
        if out["name"] not in placed.outputs or any(d < 0 for d in out["shape"][1:]):
            continue
        region, ref = placed.outputs[out["name"]]
        size = images * FP32_BYTES
        for dim in out["shape"][1:]:
            size *= dim
        region.check_room(ref.offset, size, ref.byte_size, f"output {out['name']!r}")


def read_inputs(parsed: InferRequest, placed: Placed) -> InferRequest:
    """The request with each input that lies in a region read from it (checked already by `hold`)."""
    if not placed.inputs:
        return parsed
    inputs = []
    for tensor in parsed.inputs:
        if tensor.name in placed.inputs:
            region, ref = placed.inputs[tensor.name]
            where = f"input {tensor.name!r}"
            data = memoryview(region.read(ref.offset, ref.byte_size, where))
            tensor = replace(tensor, data=binary_data(data, tensor.datatype, tensor.shape, where))
        inputs.append(tensor)
    return replace(parsed, inputs=tuple(inputs))


def write_outputs(tensors: list[tuple[Tensor, bool]], placed: Placed) -> list[tuple[Tensor, bool]]:
    """Write each output asked for in shared memory into its place, once every one is known to fit; the answer
    names the region and the bytes written there instead of carrying the data."""
    if not placed.outputs:
        return tensors
    data: dict[str, bytes] = {}
    for tensor, _ in tensors:
        if tensor.name in placed.outputs:
            region, ref = placed.outputs[tensor.name]
            data[tensor.name] = tensor_bytes(tensor)
            region.check_room(ref.offset, len(data[tensor.name]), ref.byte_size, f"output {tensor.name!r}")
    written = []
    for tensor, binary in tensors:
        if tensor.name in data:
            region, ref = placed.outputs[tensor.name]
            region.write(ref.offset, data[tensor.name], ref.byte_size, f"output {tensor.name!r}")
            tensor = replace(tensor, data=None, shared_memory=replace(ref, byte_size=len(data[tensor.name])))
        written.append((tensor, binary))
    return written


def image_count(parsed: InferRequest) -> Optional[int]:
    """How many images the request carries, from its one input's declared shape (1 for a raw body)."""
    if parsed.raw is not None:
        return 1
    if len(parsed.inputs) != 1 or not parsed.inputs[0].shape:
        return None  # refused later, naming what is wrong
    return parsed.inputs[0].shape[0]

