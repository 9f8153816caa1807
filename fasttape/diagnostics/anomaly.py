"""Anomaly mode: which op made a NaN or Inf gradient, and where it ran.

    with fasttape.detect_anomaly():
        with fasttape.GradientTape() as tape:
            loss = model(x)
        grads = tape.gradient(loss, model.trainable_variables)

    fasttape.detect_anomaly(True)      # on until fasttape.detect_anomaly(False)

While the mode is on (it is process-wide, as PyTorch's, so replica threads
and Keras' ``fit`` see it too):

- every op recorded on a fasttape tape keeps where it ran in the user's
  code: the Python stack with TensorFlow's, Keras' and fasttape's own frames
  left out (file, line, function; no frame objects, so no locals are kept
  alive), with the op type and its input and output shapes;
- every ``gradient()`` (and eager ``jacobian``) runs the backward pass op by
  op, never a compiled pass (the check needs each op's gradients), and
  checks each input gradient an op's backward function returns for NaN or
  Inf. The first one found raises ``AnomalyError`` naming the forward op
  type, its input and output shapes, the input whose gradient is bad, and
  the user's file and line that created the op. Inside a ``tf.function``
  the check is a ``CheckNumerics`` op carrying the same words, which raises
  TF's ``InvalidArgumentError`` when the function runs.

Off (the default), the recording path tests one C pointer per recorded op
and ``gradient()`` one module flag: nothing else runs.

``AnomalyError`` subclasses ``tf.errors.InvalidArgumentError``: that is what
TF's own numerics checks (``tf.debugging.check_numerics``,
``tf.debugging.enable_check_numerics``) raise for the same condition, so
handlers written for them catch it, and inside a ``tf.function`` the check
raises that very type.
"""

import linecache
import sys
import weakref

import numpy as np

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.eager import context
from tensorflow.python.framework import errors_impl
from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import math_ops

from fasttape.diagnostics import _frames
from fasttape.recording import _callback
from fasttape.recording import _recording

ENABLED = False        # (the vspace's check_gradients is set with it)

# payload (what a recorded op keeps for its backward pass) -> _OpRecord.
# Weak: a record goes when its op's payload goes (tape released, op deleted).
_RECORDS = weakref.WeakKeyDictionary()


class AnomalyError(errors_impl.InvalidArgumentError):
    """A backward function returned a NaN or Inf gradient (anomaly mode).

    Attributes: ``op_type`` (the forward op's type), ``input_index`` (the
    input whose gradient is bad), ``kind`` ("NaN" or "Inf"),
    ``gradient_shape``, ``input_shapes`` / ``output_shapes`` (per tensor a
    ``(shape, dtype name)``; empty when the op was recorded while the mode
    was off), ``stack`` (``(filename, lineno, function)`` user frames,
    innermost first) and ``filename`` / ``lineno`` (the innermost one, or
    None).
    """

    def __init__(self, node_def=None, op=None, message="", *args):
        super().__init__(node_def, op, message, *args)
        self.op_type = None
        self.input_index = None
        self.kind = None
        self.gradient_shape = None
        self.input_shapes = ()
        self.output_shapes = ()
        self.stack = ()

    @property
    def filename(self):
        return self.stack[0][0] if self.stack else None

    @property
    def lineno(self):
        return self.stack[0][1] if self.stack else None


AnomalyError.__module__ = "fasttape"   # its public name: fasttape.AnomalyError


class _OpRecord:
    __slots__ = ("op_type", "inputs", "outputs", "stack")

    def __init__(self, op_type, inputs, outputs, stack):
        self.op_type = op_type
        self.inputs = inputs
        self.outputs = outputs
        self.stack = stack


# -- switching it on and off ------------------------------------------------------

def _set(mode):
    global ENABLED
    ENABLED = bool(mode)
    _callback.set_anomaly_hook(_note if ENABLED else None)
    # Every backward function the vspace runs is checked; the compiled
    # backward declines while this is set.
    _recording.VSPACE.check_gradients = check_gradients if ENABLED else None


def is_anomaly_enabled():
    """True while anomaly mode is on."""
    return ENABLED


class detect_anomaly:  # pylint: disable=invalid-name  (PyTorch's spelling)
    """Anomaly mode, as PyTorch's ``torch.autograd.detect_anomaly`` /
    ``set_detect_anomaly``.

    ``with fasttape.detect_anomaly():`` turns it on for the block;
    ``fasttape.detect_anomaly(True)`` / ``(False)`` sets it at once, and
    used as a context manager puts the previous mode back at the end.
    """

    def __init__(self, mode=None):
        self._previous = ENABLED
        self._mode = True if mode is None else bool(mode)
        if mode is not None:
            _set(self._mode)

    def __enter__(self):
        _set(self._mode)
        return self

    def __exit__(self, *exc):
        _set(self._previous)
        return False


# -- recording: where each op ran ---------------------------------------------------

_dtype_names = {}     # DataType enum -> name


def describe(t):
    """(shape tuple or None, dtype name) of a tensor."""
    try:
        if type(t) is ops.EagerTensor:
            enum = t._datatype_enum()  # pylint: disable=protected-access
            name = _dtype_names.get(enum)
            if name is None:
                name = _dtype_names[enum] = t.dtype.name
            return t._shape_tuple(), name  # pylint: disable=protected-access
        shape = t.shape
        return (None if shape.rank is None else tuple(shape.as_list()),
                t.dtype.name)
    except Exception:  # pylint: disable=broad-except
        return None, type(t).__name__


def _note(payload, op_type, inputs, outputs):
    """The recording hook (fasttape._callback) while the mode is on."""
    try:
        _RECORDS[payload] = _OpRecord(
            op_type, tuple([describe(t) for t in inputs]),
            tuple([describe(t) for t in outputs]),
            _frames.user_stack(sys._getframe(1)))  # pylint: disable=protected-access
    except TypeError:   # a payload that takes no weak reference
        pass


def record_of(payload):
    """What anomaly mode noted for an op's payload, or None."""
    try:
        return _RECORDS.get(payload)
    except TypeError:
        return None


# -- the backward pass: checking each op's gradients ---------------------------------

def _fmt_tensor(desc):
    shape, dtype = desc
    return f"{'<unknown>' if shape is None else shape} {dtype}"


def _fmt_stack(stack):
    lines = []
    for filename, lineno, name in reversed(stack):
        lines.append(f'    File "{filename}", line {lineno}, in {name}')
        text = linecache.getline(filename, lineno).strip()
        if text:
            lines.append(f"      {text}")
    return "\n".join(lines)


def _message(op_type, record, index, kind, grad_shape):
    head = (f"{kind} in the gradient of input {index} of op {op_type!r} "
            f"(gradient shape {grad_shape}), returned by its backward function "
            f"(fasttape anomaly mode).")
    if record is None:
        return (head + f"\n  The {op_type!r} op was recorded while anomaly mode "
                "was off: record the forward pass inside "
                "fasttape.detect_anomaly() to see where it ran.")
    ins = ", ".join(_fmt_tensor(d) for d in record.inputs)
    outs = ", ".join(_fmt_tensor(d) for d in record.outputs)
    where = (_fmt_stack(record.stack) if record.stack
             else "    (no frame outside TensorFlow and fasttape)")
    return (f"{head}\n  Forward op: {op_type}, inputs: [{ins}], outputs: [{outs}]"
            f"\n  Created at (most recent call last):\n{where}")


def _error(op_type, payload, index, kind, grad_shape):
    record = record_of(payload)
    err = AnomalyError(None, None,
                       _message(op_type, record, index, kind, grad_shape))
    err.op_type = op_type
    err.input_index = index
    err.kind = kind
    err.gradient_shape = grad_shape
    if record is not None:
        err.input_shapes = record.inputs
        err.output_shapes = record.outputs
        err.stack = record.stack
    return err


def _bad_kind(values):
    """"NaN", "Inf" or None for an eager tensor."""
    if not (values.dtype.is_floating or values.dtype.is_complex):
        return None
    try:
        a = values.numpy()
        if np.isfinite(a).all():
            return None
        return "NaN" if np.isnan(a).any() else "Inf"
    except TypeError:   # a dtype NumPy cannot test: TF's ops decide
        if bool(math_ops.reduce_all(math_ops.is_finite(values))):
            return None
        return ("NaN" if bool(math_ops.reduce_any(math_ops.is_nan(values)))
                else "Inf")


def check_gradients(op_type, payload, unneeded_indices, grads):
    """Raise AnomalyError for the first NaN/Inf input gradient (eager), or
    wrap each floating one in a CheckNumerics op (graph). Gradients of
    inputs the pass does not need are not checked (nothing reads them)."""
    skip = set(unneeded_indices) if unneeded_indices else ()
    for k, g in enumerate(grads):
        if g is None or k in skip:
            continue
        sparse = isinstance(g, indexed_slices.IndexedSlices)
        values = g.values if sparse else g
        if type(values) is ops.EagerTensor:
            kind = _bad_kind(values)
            if kind is not None:
                raise _error(op_type, payload, k, kind, tuple(g.shape))
        elif (isinstance(values, tensor_lib.Tensor) and values.dtype.is_floating
              and not context.executing_eagerly()):
            message = _message(op_type, record_of(payload), k, "NaN or Inf",
                               tuple(values.shape.as_list())
                               if values.shape.rank is not None else None)
            checked = array_ops.check_numerics(values, message)
            grads[k] = (indexed_slices.IndexedSlices(checked, g.indices,
                                                     g.dense_shape)
                        if sparse else checked)
    return grads
