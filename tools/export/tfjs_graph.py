"""Turn a TensorFlow.js graph model (model.json + weights .bin) into a TensorFlow GraphDef, without tensorflowjs.

The `tensorflowjs` package has no graph-model-to-SavedModel path, and installing it downgrades
TensorFlow; what it would do is small. `graph_def_from_tfjs` parses `modelTopology` into a GraphDef
(`google.protobuf.json_format`), fills each Const from the .bin in `weightsManifest` order (float16 and
affine uint8/uint16 dequantized; int64 constants, which TFJS stores as int32, widened back), rewrites
the fused ops that only TensorFlow.js writes into the TensorFlow ops they fuse, and fails naming any op
TensorFlow does not register. Two optional passes then fit the graph for serving: `relax_batch` lets a
graph exported at batch 1 take any batch, and `drop_transposes` removes the NCHW/NHWC round trips an
ONNX-to-TensorFlow conversion leaves around every convolution. Used by tools/export/objects.py.
"""

from __future__ import annotations

import numpy as np

# Ops that TensorFlow.js writes but TensorFlow has no kernel for, and what they become.
FUSED_OPS = {"_FusedConv2D": "Conv2D", "FusedDepthwiseConv2dNative": "DepthwiseConv2dNative",
             "_FusedMatMul": "MatMul"}
FUSED_ACTIVATIONS = {"Relu", "Relu6", "Elu", "Sigmoid", "Tanh", "LeakyRelu"}
# Bytes per element as stored in the .bin, by manifest dtype or quantization dtype.
STORED = {"float32": np.float32, "int32": np.int32, "bool": np.bool_, "float16": np.float16,
          "uint8": np.uint8, "uint16": np.uint16}


def read_weights(manifest: list[dict], data: bytes) -> dict[str, np.ndarray]:
    """Cut the .bin into arrays, in manifest order, dequantized to their original dtype."""
    arrays, offset = {}, 0
    for group in manifest:
        for spec in group["weights"]:
            quantization = spec.get("quantization")
            stored = STORED[quantization["dtype"] if quantization else spec["dtype"]]
            count = int(np.prod(spec["shape"], dtype=np.int64))
            size = count * np.dtype(stored).itemsize
            if offset + size > len(data):
                raise SystemExit(f"weights end before {spec['name']} (needs bytes {offset}..{offset + size})")
            values = np.frombuffer(data, stored, count, offset).reshape(spec["shape"])
            offset += size
            if quantization and quantization["dtype"] != "float16":
                values = values * quantization["scale"] + quantization["min"]  # affine uint8/uint16
            arrays[spec["name"]] = values.astype(quantization.get("original_dtype", spec["dtype"])
                                                 if quantization else spec["dtype"])
    if offset != len(data):
        raise SystemExit(f"{len(data) - offset} bytes of weights left over; the manifest does not describe the .bin")
    return arrays


def graph_def_from_tfjs(model: dict, data: bytes):
    """Return the TFJS graph model as a TensorFlow GraphDef, every Const filled and every op TensorFlow's."""
    import tensorflow as tf
    from google.protobuf import json_format

    graph_def = json_format.ParseDict(model["modelTopology"], tf.compat.v1.GraphDef())
    weights = read_weights(model["weightsManifest"], data)
    consts = {node.name: node for node in graph_def.node if node.op == "Const"}
    missing = sorted(set(weights) - set(consts))
    if missing:
        raise SystemExit(f"weights for nodes the graph does not hold: {', '.join(missing[:5])}")
    for name, values in weights.items():
        node = consts[name]
        dtype = tf.dtypes.as_dtype(node.attr["dtype"].type)
        # TFJS has no int64: such constants are stored as int32 and widened back here
        node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(values.astype(dtype.as_numpy_dtype),
                                                                shape=values.shape))
    empty = [n for n, node in consts.items() if n not in weights and not node.attr["value"].tensor.ByteSize()]
    if empty:
        raise SystemExit(f"Const nodes without a value: {', '.join(empty[:5])}")
    rewrite_tfjs_ops(graph_def)
    check_ops(graph_def)
    return graph_def


def rewrite_tfjs_ops(graph_def) -> None:
    """Replace TFJS's fused ops (conv or matmul, then BiasAdd, then one activation) with the ops they fuse.

    The chain's last node takes the fused node's name, so that its consumers need no change; each node
    keeps only the attributes its op declares.
    """
    from tensorflow.core.framework import node_def_pb2
    from tensorflow.python.framework import op_def_registry

    def make(name, op, inputs, attrs):
        declared = {a.name for a in op_def_registry.get(op).attr}
        made = node_def_pb2.NodeDef(name=name, op=op, input=inputs)
        for key, value in attrs.items():
            if key in declared:
                made.attr[key].CopyFrom(value)
        return made

    added = []
    for node in graph_def.node:
        if node.op not in FUSED_OPS:
            continue
        fused = [op.decode() for op in node.attr["fused_ops"].list.s]
        unknown = [op for op in fused if op != "BiasAdd" and op not in FUSED_ACTIVATIONS]
        if unknown:
            raise SystemExit(f"{node.name}: {node.op} fuses {', '.join(unknown)}, which this converter does not "
                             f"rewrite (it knows BiasAdd and {', '.join(sorted(FUSED_ACTIVATIONS))})")
        inputs = [i for i in node.input if not i.startswith("^")]
        args = inputs[2:2 + int(node.attr["num_args"].i)]
        attrs = dict(node.attr.items())
        if "LeakyRelu" in fused:  # the fused op's leakyrelu_alpha, 0.2 when absent as in TensorFlow's op
            alpha = node.attr["leakyrelu_alpha"].f if "leakyrelu_alpha" in node.attr else 0.2
            attrs["alpha"] = type(node.attr["T"])(f=alpha)
        chain = [make(f"{node.name}/{FUSED_OPS[node.op]}", FUSED_OPS[node.op], inputs[:2], attrs)]
        for op in fused:
            extra = [args.pop(0)] if op == "BiasAdd" else []
            chain.append(make(f"{node.name}/{op}", op, [chain[-1].name, *extra], attrs))
        chain[-1].name = node.name
        node.CopyFrom(chain[-1])
        added.extend(chain[:-1])
    graph_def.node.extend(added)


def check_ops(graph_def) -> None:
    """Fail naming every op TensorFlow does not register (a TFJS-only op this converter does not rewrite)."""
    from tensorflow.python.framework import op_def_registry

    unknown = sorted({(node.op, node.name) for node in graph_def.node if op_def_registry.get(node.op) is None})
    if unknown:
        listed = "; ".join(f"{op} (node {name})" for op, name in unknown[:10])
        raise SystemExit(f"the graph model uses ops TensorFlow does not know and this converter does not "
                         f"rewrite: {listed}")


def relax_batch(graph_def, input_name: str, input_shape: list[int]) -> None:
    """Let any batch run: the input's batch dimension becomes unknown and each Reshape takes its batch
    from its input instead of the exported graph's constant 1. Check first that every Reshape's target
    starts with that 1, so the rewrite cannot change what a batch of one computes."""
    import tensorflow as tf
    from tensorflow.core.framework import node_def_pb2

    reshapes = [node for node in graph_def.node if node.op == "Reshape"]
    with tf.Graph().as_default() as graph:
        tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=graph) as session:
            feed = {f"{input_name}:0": np.zeros([1, *input_shape[1:]], np.float32)}
            targets = session.run([f"{node.input[1]}:0" for node in reshapes], feed)
    for node, target in zip(reshapes, targets):
        if target[0] != 1:
            raise SystemExit(f"{node.name} reshapes to {target.tolist()}: its first dimension is not the batch of 1")
    for node in graph_def.node:
        if node.name == input_name:
            node.attr["shape"].shape.dim[0].size = -1
    added = []
    for node in reshapes:
        index_type = node.attr["Tshape"]
        prefix = f"{node.name}/batch_from_input"

        def make(name, op, inputs=(), **attrs):
            made = node_def_pb2.NodeDef(name=f"{prefix}/{name}", op=op, input=list(inputs))
            for key, value in attrs.items():
                made.attr[key].CopyFrom(value)
            added.append(made)
            return made.name

        def const(name, values):
            wide = index_type.type == tf.int64.as_datatype_enum
            tensor = tf.make_tensor_proto(np.asarray(values, np.int64 if wide else np.int32))
            value = tf.compat.v1.AttrValue(tensor=tensor)
            return make(name, "Const", dtype=tf.compat.v1.AttrValue(type=tensor.dtype), value=value)

        shape = make("shape", "Shape", [node.input[0]], T=node.attr["T"], out_type=index_type)
        slice_attrs = dict(T=index_type, Index=index_type)
        batch = make("batch", "StridedSlice", [shape, const("b0", [0]), const("b1", [1]), const("s", [1])],
                     **slice_attrs)
        rest = make("rest", "StridedSlice", [node.input[1], const("r0", [1]), const("r1", [0]), const("rs", [1])],
                    end_mask=tf.compat.v1.AttrValue(i=1), **slice_attrs)
        axis = tf.make_tensor_proto(np.int32(0))
        axis_name = make("axis", "Const", dtype=tf.compat.v1.AttrValue(type=axis.dtype),
                         value=tf.compat.v1.AttrValue(tensor=axis))
        target = make("target", "ConcatV2", [batch, rest, axis_name], T=index_type, N=tf.compat.v1.AttrValue(i=2),
                      Tidx=tf.compat.v1.AttrValue(type=tf.int32.as_datatype_enum))
        node.input[1] = target
    graph_def.node.extend(added)


def drop_transposes(graph_def) -> int:
    """Remove the layout round trips that ONNX-to-TensorFlow conversion leaves around every convolution.

    onnx-tf keeps tensors in ONNX's NCHW and wraps each Conv2D, MaxPool and ResizeBilinear (which
    TensorFlow runs in NHWC on a CPU) in Transposes to NHWC and back: a quarter of the network's
    time here. This pass keeps each tensor in whatever layout it was made in, recording the
    permutation from the layout the graph means to the one it holds: a Transpose then becomes an
    Identity, ops that do not care (elementwise ones, Pad, ConcatV2 and SplitV with their padding
    rows or axis permuted) follow the held layout, and any other op is given the meant layout by a
    Transpose inserted before it. Every op computes the same numbers as before; only where they sit
    in memory changes. Return how many Transposes were removed."""
    import tensorflow as tf
    from tensorflow.core.framework import node_def_pb2

    consts = {node.name: tf.make_ndarray(node.attr["value"].tensor) for node in graph_def.node if node.op == "Const"}
    held: dict[str, tuple] = {}  # tensor -> permutation p: held = transpose(meant, p); absent: as meant
    meant: dict[str, str] = {}  # tensor -> an inserted Transpose giving it in the meant layout
    added, removed = [], 0

    def tensor(name: str) -> str:
        return name if ":" in name else f"{name}:0"

    def const(name: str, values) -> str:
        node = node_def_pb2.NodeDef(name=name, op="Const")
        proto = tf.make_tensor_proto(values)
        node.attr["dtype"].type = proto.dtype
        node.attr["value"].tensor.CopyFrom(proto)
        added.append(node)
        return name

    def as_meant(name: str) -> str:
        """The input `name`, in the layout the graph means it (a Transpose inserted when needed)."""
        if name.startswith("^") or tensor(name) not in held:
            return name
        if tensor(name) not in meant:
            key = tensor(name).replace(":", "_")
            inverse = np.argsort(held[tensor(name)]).astype(np.int32)
            node = node_def_pb2.NodeDef(name=f"{key}/as_meant", op="Transpose",
                                        input=[name, const(f"{key}/as_meant/perm", inverse)])
            node.attr["T"].type = tf.float32.as_datatype_enum
            node.attr["Tperm"].type = tf.int32.as_datatype_enum
            added.append(node)
            meant[tensor(name)] = node.name
        return meant[tensor(name)]

    def scalar(name: str) -> bool:
        return name in consts and consts[name].size == 1

    elementwise = ("LeakyRelu", "Sigmoid", "Relu", "Relu6", "Tanh", "Elu", "Add", "AddV2", "Mul", "Sub")
    for node in topological(graph_def):
        data = [i for i in node.input if not i.startswith("^")]
        # the inputs whose layout matters, and where the op's axis or paddings are
        if node.op == "Transpose" and data[1] in consts:
            flowing = data[:1]
        elif node.op in ("Pad", "PadV2", "SplitV") and len(data) > 1:
            flowing = data[:1]
        elif node.op == "ConcatV2":
            flowing = data[:-1]
        elif node.op in elementwise:
            flowing = [i for i in data if not scalar(i)]
        else:
            flowing = []
        perms = {held.get(tensor(i)) for i in flowing}
        follows = None  # the permutation this node's outputs are held in
        dropped = node.op == "Transpose" and bool(flowing)
        if dropped:
            before = held.get(tensor(data[0])) or tuple(range(len(consts[data[1]])))
            after = tuple(int(v) for v in np.argsort(consts[data[1]])[list(before)])
            node.op, node.input[:] = "Identity", [data[0]]
            for key in [k for k in node.attr if k != "T"]:
                del node.attr[key]
            removed += 1
            follows = after if after != tuple(range(len(after))) else None
        elif len(perms) == 1 and None not in perms:
            (perm,) = perms
            if node.op in elementwise:
                follows = perm
            elif node.op in ("Pad", "PadV2") and data[1] in consts:
                node.input[1] = const(f"{node.name}/held_paddings", consts[data[1]][list(perm)])
                follows = perm
            elif node.op == "ConcatV2" and data[-1] in consts:
                axis = int(consts[data[-1]]) % len(perm)
                node.input[len(data) - 1] = const(f"{node.name}/held_axis", np.int32(perm.index(axis)))
                follows = perm
            elif node.op == "SplitV" and data[2] in consts:
                axis = int(consts[data[2]]) % len(perm)
                node.input[2] = const(f"{node.name}/held_axis", np.int32(perm.index(axis)))
                follows = perm
        if follows is not None:
            outputs = int(node.attr["num_split"].i) if node.op == "SplitV" else 1
            held.update({f"{node.name}:{k}": follows for k in range(outputs)})
        elif not dropped:  # a dropped Transpose whose input is held in its output's meant layout stays as it is
            node.input[:] = [as_meant(i) for i in node.input]
    graph_def.node.extend(added)
    return removed


def topological(graph_def) -> list:
    """The graph's nodes, each after every node it reads."""
    nodes = {node.name: node for node in graph_def.node}
    done, order = set(), []
    for start in graph_def.node:
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if node.name in done:
                continue
            if expanded:
                done.add(node.name)
                order.append(node)
                continue
            stack.append((node, True))
            stack.extend((nodes[i.lstrip("^").split(":")[0]], False) for i in node.input
                         if i.lstrip("^").split(":")[0] not in done)
    return order
