"""fasttape.GradientTape: tf.GradientTape's API over fasttape's Cython core.

Every argument, result structure, warning and exception type follows
``tensorflow/python/eager/backprop.py`` (TF 2.21); only the bookkeeping and
the backward loop differ.
"""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop
from tensorflow.python.eager import backprop_util
from tensorflow.python.eager import tape as tf_tape
from tensorflow.python.framework import composite_tensor_gradient
from tensorflow.python.framework import ops
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.util import variable_utils
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.platform import tf_logging as logging
from tensorflow.python.util import nest
from tensorflow.python.util import tf_contextlib

from fasttape.diagnostics import _inspect_tape
from fasttape.recording import _recording
from fasttape.diagnostics import explain as _explain
from fasttape.recording._callback import is_trainable
from fasttape import _backward
from fasttape import _jacobians


class GradientTape:
    """Record operations for automatic differentiation (see tf.GradientTape).

    A drop-in replacement: same constructor, methods, results and errors.
    """

    def __init__(self, persistent=False, watch_accessed_variables=True):
        self._tape = None
        self._persistent = persistent
        self._watch_accessed_variables = watch_accessed_variables
        self._watched_variables = ()
        self._recording = False

    def __enter__(self):
        self._push_tape()
        return self

    def __exit__(self, typ, value, traceback):
        if self._recording:
            self._pop_tape()

    def _push_tape(self):
        if self._recording:
            raise ValueError("Tape is still recording, This can happen if you "
                             "try to re-enter an already-active tape.")
        if self._tape is None:
            self._tape = _recording.TapeState(self._persistent,
                                              self._watch_accessed_variables)
        _recording.push_tape(self._tape)
        self._recording = True

    def _pop_tape(self):
        if not self._recording:
            raise ValueError("Tape is not recording.")
        _recording.pop_tape(self._tape)
        self._recording = False

    @tf_contextlib.contextmanager
    def _ensure_recording(self):
        if not self._recording:
            try:
                self._push_tape()
                yield
            finally:
                self._pop_tape()
        else:
            yield

    def watch(self, tensor):
        """Ensures that `tensor` (tensors, variables, nests of them) is traced."""
        could_record = _recording.could_record()
        for t in backprop._extract_tensors_and_variables(tensor):  # pylint: disable=protected-access
            if not backprop_util.IsTrainable(t):
                logging.log_first_n(
                    logging.WARN, "The dtype of the watched tensor must be "
                    "floating (e.g. tf.float32), got %r", 5, t.dtype)
            if self._tape is None:  # TF: tape.watch(None, t) fails the same way
                raise AttributeError("'NoneType' object has no attribute '_tape'")
            if not could_record:
                continue  # as TF: no tape records on this thread now
            if hasattr(t, "handle"):
                for var in tf_tape._variables_override(t):  # pylint: disable=protected-access
                    self._tape.watch_variable(var)
                    pywrap_tfe.TFE_Py_VariableWatcherVariableAccessed(var)
            else:
                self._tape.core.watch(t._id)  # pylint: disable=protected-access
            _explain.note_watch(self._tape, _backward.handle_or_self(t)._id)  # pylint: disable=protected-access

    @tf_contextlib.contextmanager
    def stop_recording(self):
        """Temporarily stops recording operations on this tape."""
        if self._tape is None:
            raise RuntimeError(
                "Trying to stop recording a tape which is not recording.")
        self._pop_tape()
        try:
            yield
        finally:
            self._push_tape()

    def reset(self):
        """Clears all information stored in this tape."""
        self._pop_tape()
        self._tape = None
        self._push_tape()

    def summary(self):
        """What this tape holds for its backward pass: a TapeSummary (ops,
        saved tensors and bytes by op type, watched tensors and variables);
        ``print(tape.summary())`` shows it as a table."""
        return _inspect_tape.summary(self._tape)

    def to_dot(self, targets=None, sources=None):
        """The recorded trace as Graphviz DOT text: ops with their output
        shapes, watched tensors and variables; with ``targets`` and
        ``sources``, the ops and edges on a path from the sources to the
        targets drawn in red."""
        return _inspect_tape.to_dot(self._tape, targets, sources)

    def watched_variables(self):
        """Returns variables watched by this tape in order of construction."""
        if self._tape is not None:
            self._watched_variables = self._tape.watched_variables()
        return self._watched_variables

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=UnconnectedGradients.NONE):
        """Computes the gradient using operations recorded in context of this tape."""
        if self._tape is None:
            raise RuntimeError(_backward.CONSUMED)
        unconnected_gradients = _backward.unconnected(unconnected_gradients)
        if self._recording:
            if not self._persistent:
                self._pop_tape()
            else:
                logging.log_first_n(
                    logging.WARN, "Calling GradientTape.gradient on a persistent "
                    "tape inside its context is significantly less efficient "
                    "than calling it outside the context (it causes the "
                    "gradient ops to be recorded on the tape, leading to "
                    "increased CPU and memory usage). Only call "
                    "GradientTape.gradient inside the context if you actually "
                    "want to trace the gradient in order to compute higher "
                    "order derivatives.", 1)
        if target is None:
            raise TypeError("Argument `target` should be a list or nested "
                            "structure of Tensors, Variables or CompositeTensors "
                            "to be differentiated, but received None.")
        plain_targets, plain_sources = _plain_flat(target), _plain_flat(sources)
        if plain_targets is not None and plain_sources is not None:
            # The common case (eager tensors and variables, alone or in a
            # list or tuple) without nest and composite-tensor machinery.
            flat_targets = [_backward.handle_or_self(t) for t in plain_targets]
            flat_sources_raw = plain_sources
            flat_sources = [_backward.handle_or_self(t) for t in flat_sources_raw]
            trainable = is_trainable    # compiled; tensors only
        else:
            plain_sources = None
            trainable = backprop_util.IsTrainable   # TF's errors for non-tensors
            flat_targets = composite_tensor_gradient.get_flat_tensors_for_gradients(
                nest.flatten(target))
            flat_targets = nest.map_structure(_backward.handle_or_self, flat_targets)
            flat_sources_raw = nest.flatten(sources)
            flat_sources = composite_tensor_gradient.get_flat_tensors_for_gradients(
                [_backward.handle_or_self(t) for t in flat_sources_raw])
        for t in flat_targets:
            if not trainable(t):
                _backward.vlog_untrainable("target", t)
        for t in flat_sources:
            if not trainable(t):
                _backward.vlog_untrainable("source", t)
            if getattr(t, "is_packed", False):
                raise ValueError("GradientTape.gradient is not supported on "
                                 "packed EagerTensors yet.")
        _backward.check_tensors(flat_targets, "target")
        _backward.check_tensors(flat_sources, "sources")
        if output_gradients is not None:
            output_gradients = nest.flatten(
                variable_utils.convert_variables_to_tensors(output_gradients))
            output_gradients = (
                composite_tensor_gradient.get_flat_tensors_for_gradients(
                    output_gradients))
            output_gradients = [None if x is None else ops.convert_to_tensor(x)
                                for x in output_gradients]
            if len(output_gradients) != len(flat_targets):
                raise ValueError(
                    "Number of output gradients (%d) does not match number of "
                    "targets (%d)" % (len(output_gradients), len(flat_targets)))
        tape_state = self._tape
        if not self._persistent:
            # Consumed even if the backward pass raises, as in TF.
            self._watched_variables = tape_state.watched_variables()
            self._tape = None
        explaining = _explain.enabled()
        try:
            flat_grad = _backward.compute(
                tape_state, flat_targets, flat_sources, output_gradients,
                flat_sources_raw, unconnected_gradients, retain=explaining,
                all_watched=output_gradients is not None and any(
                    g is not None for g in output_gradients))
            if explaining:   # fasttape.explain_none(True): say why for a None
                _explain.log_nones(tape_state, flat_targets, flat_sources_raw,
                                   flat_grad)
        finally:
            if explaining and not self._persistent:
                tape_state.core.release()
        if plain_sources is not None:
            cls = type(sources)
            if cls is list:
                return flat_grad
            return tuple(flat_grad) if cls is tuple else flat_grad[0]
        flat_sources_raw = nest.map_structure(_backward.handle_or_self, flat_sources_raw)
        flat_grad = composite_tensor_gradient.replace_flat_tensors_for_gradients(
            flat_sources_raw, flat_grad)
        return nest.pack_sequence_as(sources, flat_grad)

    def explain(self, target, sources):
        """Why would gradient(target, sources) be None for each source? A
        nest like ``sources`` of fasttape.explain.Explanation (cause code,
        message, op and line where known). On a persistent tape, or before
        the first gradient() of a non-persistent one (which it leaves
        usable)."""
        if self._tape is None:
            raise RuntimeError(_backward.CONSUMED)
        return _explain.explain(self._tape, target, sources)

    def jacobian(self, target, sources,
                 unconnected_gradients=UnconnectedGradients.NONE,
                 parallel_iterations=None, experimental_use_pfor=True):
        """Computes the jacobian using operations recorded in context of this tape."""
        return _jacobians.jacobian(self, target, sources, unconnected_gradients,
                                   parallel_iterations, experimental_use_pfor)

    def batch_jacobian(self, target, source,
                       unconnected_gradients=UnconnectedGradients.NONE,
                       parallel_iterations=None, experimental_use_pfor=True):
        """Computes and stacks per-example jacobians."""
        return _jacobians.batch_jacobian(self, target, source, unconnected_gradients,
                                         parallel_iterations, experimental_use_pfor)



_ResourceVariable = resource_variable_ops.ResourceVariable


def _plain_flat(structure):
    """``structure`` as a list when it is an eager tensor or ResourceVariable,
    or a plain list or tuple of them; else None (the general path)."""
    cls = type(structure)
    if cls is ops.EagerTensor or cls is _ResourceVariable:
        return [structure]
    if cls is list or cls is tuple:
        for s in structure:
            c = type(s)
            if c is not ops.EagerTensor and c is not _ResourceVariable:
                return None
        return list(structure)
    return None
