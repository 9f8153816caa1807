"""GradientTape.jacobian and batch_jacobian (tf.GradientTape's API), and
their machinery: up to _LOOP_MAX_ROWS eager rows as that many backward passes
over the recorded trace, else TF's pfor or while loop over gradient().
"""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
import numpy as np
from tensorflow.python.eager import backprop_util
from tensorflow.python.eager import context
from tensorflow.python.framework import composite_tensor_gradient
from tensorflow.python.autograph.impl import api as autograph_api
from tensorflow.python.autograph.pyct import error_utils
from tensorflow.python.autograph.pyct import errors as pyct_errors
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import errors_impl
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_shape
from tensorflow.python.framework import tensor_util
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import array_ops_stack
from tensorflow.python.ops import check_ops
from tensorflow.python.ops import default_gradient
from tensorflow.python.ops import linalg_ops_impl
from tensorflow.python.ops.parallel_for import control_flow_ops as pfor_ops
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.util import nest
from tensorflow.python.util import tf_contextlib

from fasttape.backward import _gradient
from fasttape.gradients import _norm_rules


def gradient_rows(tape, target, flat_sources, unconnected_gradients,
                   batch, basis=None, release=True):
    """One backward pass per row of the (batch) Jacobian, all over the
    same trace; returns per source the stacked rows, or None.

    basis: the output gradients of the rows (default: the unit vectors).
    release: end a non-persistent tape afterwards (False: its caller runs
    more passes over it and ends it)."""
    unconnected_gradients = _gradient.unconnected(unconnected_gradients)
    tape_state = tape._tape
    if tape._recording and not tape._persistent:
        tape._pop_tape()
    flat_raw = list(flat_sources)
    flat = composite_tensor_gradient.get_flat_tensors_for_gradients(
        [_gradient.handle_or_self(t) for t in flat_raw])
    for t in flat:
        # As TF's gradient() in its loop_fn: TypeError for a source
        # that is not a tensor (None, object(), a string).
        if not backprop_util.IsTrainable(t):
            _gradient.vlog_untrainable("source", t)
    _gradient.check_tensors([target] + flat, "sources")
    shape = target.shape
    if basis is not None:
        n = basis.shape[0]
    elif batch:
        b = shape[0]
        n = shape.num_elements() // max(b, 1)
        basis = array_ops.reshape(
            array_ops.tile(array_ops.expand_dims(
                linalg_ops_impl.eye(n, dtype=target.dtype), 1), [1, b, 1]),
            [n] + shape.as_list())
    else:
        n = shape.num_elements()
        basis = array_ops.reshape(linalg_ops_impl.eye(n, dtype=target.dtype),
                                  [n] + shape.as_list())
    columns = [[] for _ in flat]
    try:
        for i in range(n):
            grads = _gradient.compute(tape_state, [target], flat, [basis[i]], flat_raw,
                            UnconnectedGradients.NONE, retain=True)
            for col, g in zip(columns, grads):
                col.append(g)
    finally:
        if release and not tape._persistent:
            tape._watched_variables = tape_state.watched_variables()
            tape_state.core.release()
            tape._tape = None
    out = []
    for col, src in zip(columns, flat_raw):
        if all(g is None for g in col):
            if unconnected_gradients == UnconnectedGradients.ZERO:
                col = [default_gradient.zeros_like(src)] * n
            else:
                out.append(None)
                continue
        col = [default_gradient.zeros_like(src) if g is None
               else ops.convert_to_tensor(g) for g in col]
        rows = array_ops_stack.stack(col)
        if batch:
            # [row, batch, x...] -> [batch, row..., x...]
            rank = len(rows.shape)
            rows = array_ops.transpose(rows, [1, 0] + list(range(2, rank)))
            rows = array_ops.reshape(
                rows, shape.concatenate(src.shape[1:]))
        out.append(rows)
    return out

def jacobian(tape, target, sources,
             unconnected_gradients=UnconnectedGradients.NONE,
             parallel_iterations=None, experimental_use_pfor=True):
    """Computes the jacobian using operations recorded in context of this tape."""
    if tape._tape is None:
        raise RuntimeError(_gradient.CONSUMED)
    flat_sources = nest.flatten(sources)
    grouped = _pfor_wrong(tape, target, flat_sources, experimental_use_pfor,
                          _use_loop(target))
    if _use_loop(target, grouped=grouped):
        if not experimental_use_pfor:
            _needs_persistent(tape, "jacobian")
        with _errors_as_traced(experimental_use_pfor, "jacobian"):
            rows = gradient_rows(tape, target, flat_sources,
                                       unconnected_gradients, batch=False)
        output = [None if r is None else array_ops.reshape(
            r, target.shape.concatenate(s.shape))
                  for r, s in zip(rows, flat_sources)]
        return nest.pack_sequence_as(sources, output)
    target_static_shape = target.shape
    target_shape = array_ops.shape(target)
    with tape._ensure_recording():
        target = array_ops.reshape(target, [-1])

    def loop_fn(i):
        with tape._ensure_recording():
            y = array_ops.gather(target, i)
        return tape.gradient(y, flat_sources,
                             unconnected_gradients=unconnected_gradients)

    try:
        target_size = int(target.shape[0])
    except TypeError:
        target_size = array_ops.shape(target)[0]

    if experimental_use_pfor and not grouped:
        output = _pfor(loop_fn, target_size, parallel_iterations, "jacobian")
    else:
        if context.executing_eagerly() and not grouped:
            _needs_persistent(tape, "jacobian")
        # Each row's gradient has its source's dtype (TF declares the
        # target's, and its TensorArray then fails for a float32 source
        # of a float64 target, or an int source).
        output = pfor_ops.for_loop(
            loop_fn, [_source_dtype(s, target.dtype) for s in flat_sources],
            target_size, parallel_iterations=parallel_iterations)

    for i, out in enumerate(output):
        if out is not None:
            new_shape = array_ops.concat(
                [target_shape, array_ops.shape(out)[1:]], axis=0)
            out = array_ops.reshape(out, new_shape)
            if context.executing_eagerly():
                out.set_shape(target_static_shape.concatenate(
                    flat_sources[i].shape))
        output[i] = out

    return nest.pack_sequence_as(sources, output)

def batch_jacobian(tape, target, source,
                   unconnected_gradients=UnconnectedGradients.NONE,
                   parallel_iterations=None, experimental_use_pfor=True):
    """Computes and stacks per-example jacobians."""
    if tape._tape is None:
        raise RuntimeError("A non-persistent GradientTape can only be used to"
                           "compute one set of gradients (or jacobians)"
                           + _gradient.USE_PERSISTENT)
    target_shape = target.shape
    grouped = _pfor_wrong(tape, target, nest.flatten(source),
                          experimental_use_pfor, _use_loop(target, batch=True))
    loop = _use_loop(target, batch=True, grouped=grouped)
    nested = nest.is_nested(source)
    if not (loop and nested):   # TF's check, its errors and messages
        dim = (tensor_shape.Dimension(None) if target_shape.rank is None
               else target_shape.dims[0])
        if not (target_shape.with_rank_at_least(2) and
                source.shape.with_rank_at_least(2) and
                dim.is_compatible_with(source.shape[0])):
            raise ValueError(
                "Need first dimension of target shape (%s) and "
                "source shape (%s) to match." % (target.shape, source.shape))
    if loop and not nested:
        if not experimental_use_pfor:
            _needs_persistent(tape, "batch_jacobian")
        with _errors_as_traced(experimental_use_pfor, "batch_jacobian"):
            [rows] = gradient_rows(tape, target, [source],
                                         unconnected_gradients, batch=True)
        if rows is None:
            return array_ops.zeros(
                target_shape.concatenate(source.shape[1:]), target.dtype)
        return rows
    if loop:
        # fasttape extension: a nest of sources (TF takes one tensor).
        flat = nest.flatten(source)
        with _errors_as_traced(experimental_use_pfor, "batch_jacobian"):
            rows = gradient_rows(tape, target, flat, unconnected_gradients,
                                       batch=True)
        return nest.pack_sequence_as(source, rows)
    if target_shape.is_fully_defined():
        batch_size = int(target_shape[0])
        target_row_size = target_shape.num_elements() // batch_size
    else:
        target_shape = array_ops.shape(target)
        batch_size = target_shape[0]
        target_row_size = array_ops.size(target) // batch_size
    source_shape = array_ops.shape(source)
    with tape._ensure_recording():
        with ops.control_dependencies(
                [check_ops.assert_equal(batch_size, source_shape[0])]):
            target = array_ops.reshape(target, [batch_size, target_row_size])

    run_once = False

    def loop_fn(i):
        nonlocal run_once
        if run_once and not tape._persistent:
            if parallel_iterations is not None:
                raise RuntimeError(
                    "GradientTape must be created with persistent=True"
                    " to compute the batch_jacobian with parallel_iterations.")
            else:
                raise RuntimeError(
                    "GradientTape must be created with persistent=True"
                    " to compute the batch_jacobian.")
        run_once = True
        with tape._ensure_recording():
            y = array_ops.gather(target, i, axis=1)
        return tape.gradient(y, source,
                             unconnected_gradients=unconnected_gradients)

    if experimental_use_pfor and not grouped:
        output = _pfor(loop_fn, target_row_size, parallel_iterations,
                       "batch_jacobian")
    else:
        if context.executing_eagerly() and not grouped:
            _needs_persistent(tape, "batch_jacobian")
        output = pfor_ops.for_loop(
            loop_fn, _source_dtype(source, target.dtype), target_row_size,
            parallel_iterations=parallel_iterations)
    new_shape = array_ops.concat([target_shape, source_shape[1:]], axis=0)
    if output is None:
        return array_ops.zeros(new_shape, target.dtype)
    output = array_ops.reshape(output, [target_row_size, batch_size, -1])
    output = array_ops.transpose(output, [1, 0, 2])
    return array_ops.reshape(output, new_shape)

_NOT_PERSISTENT = {   # TF's messages, word for word (double spaces included)
    "jacobian": ("GradientTape must be created with persistent=True to compute "
                 "the jacobian with eager execution enabled and with  "
                 "experimental_use_pfor set to False."),
    "batch_jacobian": ("GradientTape must be created with persistent=True to "
                       "compute the batch_jacobian with eager execution enabled "
                       "and  with experimental_use_pfor set to False."),
}


def _needs_persistent(tape, what):
    """TF's RuntimeError for an eager loop jacobian on a non-persistent tape."""
    if not tape._persistent:  # pylint: disable=protected-access
        raise RuntimeError(_NOT_PERSISTENT[what])


def _vectorizing_error(what):
    return ValueError(
        f"Encountered an exception while vectorizing the {what} "
        "computation. Vectorization can be disabled by setting "
        "experimental_use_pfor to False.")


def _pfor(loop_fn, n, parallel_iterations, what):
    try:
        return pfor_ops.pfor(loop_fn, n, parallel_iterations=parallel_iterations)
    except ValueError as err:
        raise _vectorizing_error(what) from err


_LOOP_MAX_ROWS = 1024

# Exception types that AutoGraph re-raises as themselves from a traced
# function (api._ErrorMetadata.create_exception); it turns any other into a
# StagingError.
_TRACE_KEEPS = (error_utils.KNOWN_STRING_CONSTRUCTOR_ERRORS + (
    KeyError, errors_impl.OpError, pyct_errors.PyCTError,
    autograph_api.StagingError, errors_impl.InaccessibleTensorError,
    errors_impl.OperatorNotAllowedInGraphError))


@tf_contextlib.contextmanager
def _errors_as_traced(pfor, what):
    """Eager jacobians with pfor run in TF inside a traced tf.function;
    fasttape's row loop does not trace. Raise what the trace would: e.g.
    the LookupError of a missing second-order gradient is TF's StagingError
    there (without pfor TF raises the LookupError, as fasttape does), and a
    ValueError is pfor's "while vectorizing" one (_pfor)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised, maybe retyped
        kind = type(err)
        if not pfor:
            raise
        if isinstance(err, ValueError):
            raise _vectorizing_error(what) from err
        if (isinstance(err, _TRACE_KEEPS)
                or kind.__init__ is Exception.__init__):
            raise
        raise autograph_api.StagingError(
            f"in user code:\n\n\n    {kind.__name__}: {err}\n") from err


def _source_dtype(source, target_dtype):
    """The dtype of a gradient with respect to ``source`` (TF's choice, the
    target's, where a resource handle carries no dtype)."""
    dtype = getattr(source, "dtype", None)
    if dtype is None:   # TF's error for a non-tensor source
        backprop_util.IsTrainable(source)
    if dtype == dtypes.resource:
        try:
            return dtypes.as_dtype(default_gradient.get_zeros_dtype(source))
        except ValueError:
            return target_dtype
    return dtypes.as_dtype(dtype).base_dtype   # (a Keras 3 variable's is a str)


def _use_loop(target, batch=False, grouped=False):
    """Eager Jacobians of up to _LOOP_MAX_ROWS rows run as that many backward
    passes over the recorded trace: no tracing, no pfor rewrite, a fixed cost
    per row. Larger or symbolic ones go through TF's pfor, as in TF, but
    where an op pfor converts wrongly is on the path (pfor_wrong_on_path):
    eagerly they run as backward passes at any size, while tracing as
    TF's while loop (experimental_use_pfor=False's)."""
    if not context.executing_eagerly() or not isinstance(target, ops.EagerTensor):
        return False
    shape = target.shape
    if not shape.is_fully_defined() or (batch and shape.rank < 2):
        return False
    rows = shape.num_elements()
    if batch:
        rows //= max(shape[0], 1)
    return 0 < rows and (grouped or rows <= _LOOP_MAX_ROWS)


# Grouped convolutions (a kernel with fewer input channels than its input):
# pfor's converters for their gradients fold the vectorized rows into the
# kernel's output channels, which a grouped kernel gradient splits by group,
# not by row. The Jacobian or per-example rows come out silently wrong (or
# pfor's op raises), so where one is on the path they run as a loop.
_CONVOLUTIONS = frozenset({"Conv2D", "Conv3D"})
# The gradients' ops: (input channels, kernel input channels) read from
# their inputs (input, filter_sizes, ...) and (input_sizes, filter, ...).
_FILTER_GRADS = frozenset({"Conv2DBackpropFilter", "Conv3DBackpropFilterV2"})
_INPUT_GRADS = frozenset({"Conv2DBackpropInput", "Conv3DBackpropInputV2"})
_CALLS = ("f", "then_branch", "else_branch", "body", "cond")


def _channels(fmt):
    if isinstance(fmt, bytes):
        fmt = fmt.decode()
    return 1 if fmt in ("NCHW", "NCDHW") else -1


def _dims(value):
    """The static shape of a tensor, or the constant value of a shape
    tensor, as a list (None: unknown)."""
    if value is None:
        return None
    shape = tensor_shape.TensorShape(value.shape)
    return None if shape.rank is None else shape.as_list()


def _const(value):
    try:
        v = tensor_util.constant_value(value)
    except (TypeError, ValueError):
        return None
    return None if v is None else list(v)


def _is_grouped(op_type, inputs, fmt):
    """Whether a (graph or eager) convolution or convolution-gradient op is
    grouped; True where it cannot tell (the loop is always right)."""
    axis = _channels(fmt)
    if op_type in _CONVOLUTIONS:
        x, k = _dims(inputs[0]), _dims(inputs[1])
    elif op_type in _FILTER_GRADS:
        x, k = _dims(inputs[0]), _const(inputs[1])
    else:
        x, k = _const(inputs[0]), _dims(inputs[1])
    if x is None or k is None or x[axis] is None or k[-2] is None:
        return True
    return x[axis] != k[-2]


def _backward_body(payload):
    """The graph of the backward function TF recorded with an eager
    function call (its closure holds it), or None."""
    fn = getattr(payload, "fn", None)
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, getattr(fn, "__closure__", None) or ()):
        if name == "backward":
            return getattr(cell.cell_contents, "graph", None)
    return None


def _roll_misread(inputs):
    """Whether a Roll (or its gradient, a Roll) with these inputs is one
    pfor converts wrongly: its converter adds 1 to the axis for the loop's,
    so an axis counted from the end names the next one (TF 2.21; TF's own
    vectorized_map is silently wrong there too). True where the axis is
    not known."""
    axis = inputs[2] if len(inputs) > 2 else None
    try:
        axis = None if axis is None else tensor_util.constant_value(axis)
    except (TypeError, ValueError):
        axis = None
    return axis is None or bool((np.asarray(axis) < 0).any())


def _einsum_unvectorized(equation):
    """Whether pfor cannot vectorize an Einsum of ``equation`` or its
    gradient: a label repeated within an operand or the output (a diagonal,
    "ii->i", whose gradient writes one, "i->ii"). pfor's converter builds
    its equation for tf.einsum, which refuses a label repeated in the
    output ("ai->aii"), where the Einsum op itself takes it. True where the
    equation is not known (the loop is always right)."""
    if isinstance(equation, bytes):
        equation = equation.decode()
    if not isinstance(equation, str) or "->" not in equation:
        return True
    for subs in equation.replace("->", ",").split(","):
        labels = subs.replace("...", "").replace(" ", "")
        if len(set(labels)) != len(labels):
            return True
    return False


def pfor_wrong_on_path(tape_state, target, sources):
    """Whether an op pfor vectorizes wrongly is on the path from
    ``sources`` to ``target``: a grouped convolution (see above), or a
    Roll along an axis counted from the end (_roll_misread); recorded
    directly, inside a recorded function call (Keras 3 runs one in a
    jit_compile function), traced or eager (there, its backward function's
    body). Then rows are built by a loop, not pfor."""
    ids = [t._id for t in sources if hasattr(t, "_id")]  # pylint: disable=protected-access
    if not hasattr(target, "_id"):
        return False
    plan = tape_state.core.plan([target._id], ids)  # pylint: disable=protected-access
    if plan is None:
        return False
    graph = ops.get_default_graph()
    seen = set()
    todo = []
    for e in plan[1]:
        payload = e.payload
        op = getattr(payload, "op", None)
        if op is not None:
            todo.append(op)
            continue
        eager = hasattr(payload, "attrs")
        if e.op_type in _CONVOLUTIONS and eager and _is_grouped(
                e.op_type, payload.inputs,
                _norm_rules.attr(payload, "data_format", "NHWC")):
            return True
        if e.op_type == "Roll" and _roll_misread(getattr(payload, "inputs", None) or ()):
            return True
        if e.op_type == "Einsum" and _einsum_unvectorized(
                _norm_rules.attr(payload, "equation") if eager else None):
            return True
        body = _backward_body(payload)
        if body is not None:
            todo.extend(body.get_operations())
        if e.op_type not in seen:
            seen.add(e.op_type)
            body = getattr(graph._get_function(e.op_type), "graph", None)  # pylint: disable=protected-access
            if body is not None:
                todo.extend(body.get_operations())
    while todo:
        op = todo.pop()
        kind = op.type
        if ((kind in _CONVOLUTIONS or kind in _FILTER_GRADS
             or kind in _INPUT_GRADS) and len(op.inputs) > 1
                and _is_grouped(kind, op.inputs, op.get_attr("data_format"))):
            return True
        if kind == "Roll" and _roll_misread(op.inputs):
            return True
        if kind == "Einsum" and _einsum_unvectorized(op.get_attr("equation")):
            return True
        for name in _CALLS:
            try:
                fname = op.get_attr(name).name
            except (ValueError, AttributeError):
                continue
            if fname not in seen:
                seen.add(fname)
                fn = op.graph._get_function(fname) or graph._get_function(fname)  # pylint: disable=protected-access
                body = getattr(fn, "graph", None)
                if body is not None:
                    todo.extend(body.get_operations())
    return False


def _pfor_wrong(tape, target, flat_raw, use_pfor, loop):
    """Whether pfor would build these Jacobian rows and be wrong there
    (pfor_wrong_on_path): then they run as a loop."""
    if not use_pfor or loop or not hasattr(target, "_id"):
        return False
    try:
        flat = composite_tensor_gradient.get_flat_tensors_for_gradients(
            [_gradient.handle_or_self(t) for t in flat_raw])
    except (TypeError, ValueError, AttributeError):
        return False   # not sources: TF's error comes from gradient()
    return pfor_wrong_on_path(tape._tape, target, flat)  # pylint: disable=protected-access
