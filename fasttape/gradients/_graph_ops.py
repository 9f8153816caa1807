"""One op in the graph being traced, from its type, flat inputs and flat
(name, value, ...) attrs as TF's eager fast path takes them: how a compiled
pass re-makes a memory budget's dropped tensors (recording._budget) and
how the per-example norm rules build their ops when traced (_norm_rules).
"""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_shape
from tensorflow.python.framework import tensor_util


def graph_op(op_type, inputs, attrs):
    """The outputs of a new ``op_type`` op in the default graph. ``attrs``
    may leave out the attrs TF's graph builder fills in (those with a
    default) and the type attrs of single-tensor inputs (read from the
    inputs, as TF's generated wrappers infer them)."""
    op_def = op_def_registry.get(op_type)
    kinds = {a.name: a.type for a in op_def.attr}
    protos = {attrs[j]: attr_value(kinds[attrs[j]], attrs[j + 1])
              for j in range(0, len(attrs) - 1, 2)}
    if len(inputs) == len(op_def.input_arg):
        for arg, x in zip(op_def.input_arg, inputs):
            name = arg.type_attr
            if name and not arg.number_attr and name not in protos:
                protos[name] = attr_value("type", x.dtype)
    op = ops.get_default_graph()._create_op_internal(  # pylint: disable=protected-access
        op_type, inputs, attrs=protos)
    return op.outputs


def attr_value(kind, value):
    """An AttrValue proto of an op_def attr kind ("type", "list(int)"...)."""
    if kind == "type":
        return attr_value_pb2.AttrValue(type=dtypes.as_dtype(value).as_datatype_enum)
    if kind == "bool":
        return attr_value_pb2.AttrValue(b=bool(value))
    if kind == "int":
        return attr_value_pb2.AttrValue(i=int(value))
    if kind == "float":
        return attr_value_pb2.AttrValue(f=float(value))
    if kind == "string":
        return attr_value_pb2.AttrValue(
            s=value if isinstance(value, bytes) else str(value).encode())
    if kind == "shape":
        return attr_value_pb2.AttrValue(
            shape=tensor_shape.as_shape(value).as_proto())
    if kind == "tensor":
        return attr_value_pb2.AttrValue(tensor=tensor_util.make_tensor_proto(value))
    if kind.startswith("list("):
        inner = kind[5:-1]
        lst = attr_value_pb2.AttrValue.ListValue()
        for v in value:
            one = attr_value(inner, v)
            field = one.WhichOneof("value")
            if field in ("shape", "tensor"):
                getattr(lst, field).add().CopyFrom(getattr(one, field))
            else:
                getattr(lst, field).append(getattr(one, field))
        return attr_value_pb2.AttrValue(list=lst)
    raise TypeError(f"an attr of kind {kind} cannot be re-made in a graph")
