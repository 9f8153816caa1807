"""fasttape.GradientTape: tf.GradientTape's API over fasttape's Cython core.

Every argument, result structure, warning and exception type follows
``tensorflow/python/eager/backprop.py`` (TF 2.21); only the bookkeeping and
the backward loop differ.
"""

from fasttape import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop
from tensorflow.python.eager import backprop_util
from tensorflow.python.eager import context
from tensorflow.python.eager import tape as tf_tape
from tensorflow.python.framework import composite_tensor_gradient
from tensorflow.python.autograph.impl import api as autograph_api
from tensorflow.python.autograph.pyct import error_utils
from tensorflow.python.autograph.pyct import errors as pyct_errors
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import errors_impl
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_shape
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import array_ops_stack
from tensorflow.python.ops import check_ops
from tensorflow.python.ops import default_gradient
from tensorflow.python.ops import linalg_ops_impl
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.util import variable_utils
from tensorflow.python.ops.parallel_for import control_flow_ops as pfor_ops
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.platform import tf_logging as logging
from tensorflow.python.util import nest
from tensorflow.python.util import tf_contextlib

from fasttape import _compiled
from fasttape import _inspect_tape
from fasttape import _recording
from fasttape import explain as _explain
from fasttape import anomaly as _anomaly
from fasttape._callback import is_trainable, output_meta
_handle_or_self = backprop._handle_or_self  # pylint: disable=protected-access

# TF's text, then what to do about it.
_USE_PERSISTENT = (". To compute more than one, create the tape with "
                   "GradientTape(persistent=True) (and `del` it when done, "
                   "to free what it holds)")
_CONSUMED = ("A non-persistent GradientTape can only be used to compute one "
             "set of gradients (or jacobians)" + _USE_PERSISTENT)


def _unconnected(value):
    try:
        return UnconnectedGradients(value)
    except ValueError:
        raise ValueError(
            "Unknown value for unconnected_gradients: %r" % value) from None


def compute(tape_state, flat_targets, flat_sources, output_gradients,
            flat_sources_raw, unconnected_gradients, retain=False,
            all_watched=False):
    """Run the core's backward pass for flat lists of tensors.

    all_watched: run the backward function of every op between the targets
    and any watched tensor, as TF's tape does, not only of those that lead
    to a source. Given for output_gradients from the user: TF's gradient
    functions then check them (a seed of the wrong dtype or shape fails
    there even when no source is connected)."""
    unconnected_gradients = _unconnected(unconnected_gradients)
    target_ids = [t._id for t in flat_targets]  # pylint: disable=protected-access
    source_ids = [t._id for t in flat_sources]  # pylint: disable=protected-access
    targets_set = set(target_ids)
    sources_that_are_targets = {
        t._id: output_meta(t)  # pylint: disable=protected-access
        for t in flat_sources if t._id in targets_set}  # pylint: disable=protected-access
    core, vspace = tape_state.core, _recording.VSPACE
    checking = _anomaly.ENABLED
    if checking:
        # Anomaly mode: the eager pass (never a compiled one), each op's
        # input gradients checked for NaN/Inf.
        vspace = _anomaly.checking_vspace(vspace)
    target_meta = [output_meta(t) for t in flat_targets]

    def eager_pass():
        return core.compute_gradient(
            vspace, target_ids, source_ids, sources_that_are_targets,
            output_gradients, True, retain, target_meta, all_watched)

    if checking:
        grads = eager_pass()
    else:
        grads = _compiled.gradient(core, vspace, target_ids, source_ids,
                                   sources_that_are_targets, output_gradients,
                                   retain, target_meta, eager_pass, all_watched)
    if unconnected_gradients == UnconnectedGradients.ZERO:
        grads = [default_gradient.zeros_like(flat_sources_raw[i])
                 if g is None else g for i, g in enumerate(grads)]
    return grads


class GradientTape:
    """Record operations for automatic differentiation, as ``tf.GradientTape``.

    A drop-in replacement: the same constructor, methods, results, warnings
    and exception types (``fasttape.patch()`` swaps it in for TF's class).
    Operations are recorded if they run inside the ``with`` block and at
    least one of their inputs is watched; trainable Variables are watched
    when read.

    >>> x = tf.constant(3.0)
    >>> with fasttape.GradientTape() as g:
    ...   g.watch(x)
    ...   y = x * x
    >>> print(g.gradient(y, x))
    tf.Tensor(6.0, shape=(), dtype=float32)

    Tapes nest for higher-order derivatives, and a persistent tape
    (``persistent=True``) allows several ``gradient()`` calls, as in TF.

    Beyond TF's API: ``explain()`` (why a gradient is None), ``summary()``
    and ``to_dot()`` (what the tape holds). Differences from TF are listed,
    each with its test, in docs/differences.md.
    """

    def __init__(self, persistent=False, watch_accessed_variables=True):
        """Creates a new GradientTape.

        Args:
          persistent: Boolean controlling whether a persistent gradient tape
            is created. False by default, which means at most one call can
            be made to the gradient() method on this object.
          watch_accessed_variables: Boolean controlling whether the tape will
            automatically `watch` any (trainable) variables accessed while
            the tape is active. Defaults to True. If False users must
            explicitly `watch` any `Variable`s they want to request
            gradients from.
        """
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
        """Ensures that `tensor` is being traced by this tape.

        Args:
          tensor: a Tensor/Variable or a nested structure of them. A tensor
            of an integer or boolean dtype is accepted with TF's warning;
            its gradient is None.

        Raises:
          ValueError: if it encounters something that is not a tensor.
        """
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
            _explain.note_watch(self._tape, _handle_or_self(t)._id)  # pylint: disable=protected-access

    @tf_contextlib.contextmanager
    def stop_recording(self):
        """Temporarily stops recording operations on this tape.

        Operations executed while this context manager is active are not
        recorded on the tape, which reduces the memory it holds.

        Yields:
          None
        Raises:
          RuntimeError: if the tape is not currently recording.
        """
        if self._tape is None:
            raise RuntimeError(
                "Trying to stop recording a tape which is not recording.")
        self._pop_tape()
        try:
            yield
        finally:
            self._push_tape()

    def reset(self):
        """Clears all information stored in this tape.

        Equivalent to exiting and re-entering the tape's context manager
        with a new tape, for a reset point inside the ``with`` block (in a
        branch, say).
        """
        self._pop_tape()
        self._tape = None
        self._push_tape()

    def summary(self):
        """What this tape holds for its backward pass (not in TF).

        Returns:
          A TapeSummary: the recorded ops by type, the tensors each type
          keeps alive for the backward pass and their bytes (``held_bytes``
          is what the tape adds to memory), and the watched tensors and
          variables. ``print(tape.summary())`` shows it as a table.
        """
        return _inspect_tape.summary(self._tape)

    def to_dot(self, targets=None, sources=None):
        """The recorded trace as Graphviz DOT text (not in TF).

        Args:
          targets: optional, a tensor or nested structure of tensors.
          sources: optional, a tensor/Variable or nested structure of them.
            With both, the ops and edges on a path from the sources to the
            targets are drawn in red.

        Returns:
          A str in the DOT language: a box per op (its type and output
          shapes, where known) and an ellipse per watched tensor or
          variable. Render it with Graphviz (``dot -Tpng``).
        """
        return _inspect_tape.to_dot(self._tape, targets, sources)

    def watched_variables(self):
        """Returns variables watched by this tape in order of construction.

        Returns:
          A tuple of the watched Variables.
        """
        if self._tape is not None:
            self._watched_variables = self._tape.watched_variables()
        return self._watched_variables

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=UnconnectedGradients.NONE):
        """Computes the gradient using operations recorded in context of this tape.

        Note: Unless you set `persistent=True` a GradientTape can only be used
        to compute one set of gradients (or jacobians).

        Composite tensors (RaggedTensor, IndexedSlices...) are supported as
        targets and sources, as in TF.

        Args:
          target: a list or nested structure of Tensors or Variables or
            CompositeTensors to be differentiated.
          sources: a list or nested structure of Tensors or Variables or
            CompositeTensors. `target` will be differentiated against
            elements in `sources`.
          output_gradients: a list of gradients, one for each differentiable
            element of target. Defaults to None.
          unconnected_gradients: a value which can either hold 'none' or
            'zero' and alters the value which will be returned if the target
            and sources are unconnected. The possible values and effects are
            detailed in 'tf.UnconnectedGradients' and it defaults to 'none'.

        Returns:
          a list or nested structure of Tensors (or IndexedSlices, or None,
          or CompositeTensor), one for each element in `sources`. Returned
          structure is the same as the structure of `sources`.

        Raises:
          RuntimeError: If called on a used, non-persistent tape (the
            message adds: create it with ``persistent=True``).
          RuntimeError: If called inside the context of the tape.
          TypeError: If the target is a None object.
          ValueError: If the target is a variable or if unconnected
            gradients is called with an unknown value.
          AttributeError: If a target or source is not a tensor (a NumPy
            array, say), as TF; the message adds how to fix it.
          LookupError: If an op on a path to a source has no registered
            gradient, as TF.
          fasttape.AnomalyError: In anomaly mode, if a backward function
            returns a NaN or Inf gradient.

        Differences from TF: the backward pass of a loop that records the
        same program step after step is compiled once and replayed (same
        results; ``FASTTAPE_COMPILED_BACKWARD=off`` turns it off); with
        ``fasttape.explain_none(True)`` each None is also logged with its
        cause. Misuse where TF misbehaves is refused: more or fewer
        `output_gradients` than targets raises ValueError (TF uses the
        first ones, or crashes), and a None entry in `output_gradients`
        stands for ones. See docs/differences.md.
        """
        if self._tape is None:
            raise RuntimeError(_CONSUMED)
        unconnected_gradients = _unconnected(unconnected_gradients)
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
            flat_targets = [_handle_or_self(t) for t in plain_targets]
            flat_sources_raw = plain_sources
            flat_sources = [_handle_or_self(t) for t in flat_sources_raw]
            trainable = is_trainable    # compiled; tensors only
        else:
            plain_sources = None
            trainable = backprop_util.IsTrainable   # TF's errors for non-tensors
            flat_targets = composite_tensor_gradient.get_flat_tensors_for_gradients(
                nest.flatten(target))
            flat_targets = nest.map_structure(_handle_or_self, flat_targets)
            flat_sources_raw = nest.flatten(sources)
            flat_sources = composite_tensor_gradient.get_flat_tensors_for_gradients(
                [_handle_or_self(t) for t in flat_sources_raw])
        for t in flat_targets:
            if not trainable(t):
                _vlog_untrainable("target", t)
        for t in flat_sources:
            if not trainable(t):
                _vlog_untrainable("source", t)
            if getattr(t, "is_packed", False):
                raise ValueError("GradientTape.gradient is not supported on "
                                 "packed EagerTensors yet.")
        _check_tensors(flat_targets, "target")
        _check_tensors(flat_sources, "sources")
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
            flat_grad = compute(
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
        flat_sources_raw = nest.map_structure(_handle_or_self, flat_sources_raw)
        flat_grad = composite_tensor_gradient.replace_flat_tensors_for_gradients(
            flat_sources_raw, flat_grad)
        return nest.pack_sequence_as(sources, flat_grad)

    def explain(self, target, sources):
        """Why would ``gradient(target, sources)`` be None for each source?
        (Not in TF.)

        Works on a persistent tape, or on a non-persistent one before its
        ``gradient()``, which it leaves usable. With
        ``fasttape.explain_none(True)`` on before the tape was entered, every
        cause can be told apart; without it, some are listed as possible.

        Args:
          target: a Tensor or nested structure of Tensors, as for gradient().
          sources: a Tensor/Variable or nested structure of them.

        Returns:
          A nested structure like `sources` of fasttape.Explanation: `cause`
          (a code of fasttape.explain.CAUSES), `message` (what happened and
          what to do), `op_type`, `op_name`, `line` (the user's
          ``file:line``) where known, and `certain`.

        Raises:
          RuntimeError: If called on a used, non-persistent tape.
        """
        if self._tape is None:
            raise RuntimeError(_CONSUMED)
        return _explain.explain(self._tape, target, sources)

    def _gradient_rows(self, target, flat_sources, unconnected_gradients,
                       batch):
        """One backward pass per row of the (batch) Jacobian, all over the
        same trace; returns per source the stacked rows, or None."""
        unconnected_gradients = _unconnected(unconnected_gradients)
        tape_state = self._tape
        if self._recording and not self._persistent:
            self._pop_tape()
        flat_raw = list(flat_sources)
        flat = composite_tensor_gradient.get_flat_tensors_for_gradients(
            [_handle_or_self(t) for t in flat_raw])
        for t in flat:
            # As TF's gradient() in its loop_fn: TypeError for a source
            # that is not a tensor (None, object(), a string).
            if not backprop_util.IsTrainable(t):
                _vlog_untrainable("source", t)
        _check_tensors([target] + flat, "sources")
        shape = target.shape
        if batch:
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
                grads = compute(tape_state, [target], flat, [basis[i]], flat_raw,
                                UnconnectedGradients.NONE, retain=True)
                for col, g in zip(columns, grads):
                    col.append(g)
        finally:
            if not self._persistent:
                self._watched_variables = tape_state.watched_variables()
                tape_state.core.release()
                self._tape = None
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

    def jacobian(self, target, sources,
                 unconnected_gradients=UnconnectedGradients.NONE,
                 parallel_iterations=None, experimental_use_pfor=True):
        """Computes the jacobian using operations recorded in context of this tape.

        Note: Unless you set `persistent=True` a GradientTape can only be used
        to compute one set of gradients (or jacobians).

        Args:
          target: Tensor to be differentiated.
          sources: a list or nested structure of Tensors or Variables.
            `target` will be differentiated against elements in `sources`.
          unconnected_gradients: a value which can either hold 'none' or
            'zero' and alters the value which will be returned if the target
            and sources are unconnected. The possible values and effects are
            detailed in 'tf.UnconnectedGradients' and it defaults to 'none'.
          parallel_iterations: A knob to control how many iterations are
            dispatched in parallel (pfor and while_loop paths).
          experimental_use_pfor: If true, vectorizes the jacobian
            computation. Else falls back to a sequential while_loop.

        Returns:
          A list or nested structure of Tensors (or None), one for each
          element in `sources`. Returned structure is the same as the
          structure of `sources`. Sparse (IndexedSlices) gradients are made
          dense, as in TF.

        Raises:
          RuntimeError: If called on a used, non-persistent tape.
          RuntimeError: If called on a non-persistent tape with eager
            execution enabled and without enabling experimental_use_pfor.
          ValueError: If vectorization of jacobian computation fails.

        Differences from TF: in eager mode, for a target of up to 1024
        elements, fasttape runs one backward pass per element over the
        recorded trace instead of tracing a pfor function on each call (no
        tracing; the same results, and right ones where TF's pfor fails or
        gives wrong zeros); errors are raised as TF's traced pfor raises
        them. See docs/differences.md.
        """
        if self._tape is None:
            raise RuntimeError(_CONSUMED)
        flat_sources = nest.flatten(sources)
        if _use_loop(target):
            if not experimental_use_pfor and not self._persistent:
                raise RuntimeError(
                    "GradientTape must be created with persistent=True"
                    " to compute the jacobian with eager execution enabled and "
                    "with  experimental_use_pfor set to False.")
            with _errors_as_traced(experimental_use_pfor, "jacobian"):
                rows = self._gradient_rows(target, flat_sources,
                                           unconnected_gradients, batch=False)
            output = [None if r is None else array_ops.reshape(
                r, target.shape.concatenate(s.shape))
                      for r, s in zip(rows, flat_sources)]
            return nest.pack_sequence_as(sources, output)
        target_static_shape = target.shape
        target_shape = array_ops.shape(target)
        with self._ensure_recording():
            target = array_ops.reshape(target, [-1])

        def loop_fn(i):
            with self._ensure_recording():
                y = array_ops.gather(target, i)
            return self.gradient(y, flat_sources,
                                 unconnected_gradients=unconnected_gradients)

        try:
            target_size = int(target.shape[0])
        except TypeError:
            target_size = array_ops.shape(target)[0]

        if experimental_use_pfor:
            output = _pfor(loop_fn, target_size, parallel_iterations, "jacobian")
        else:
            if context.executing_eagerly() and not self._persistent:
                raise RuntimeError(
                    "GradientTape must be created with persistent=True"
                    " to compute the jacobian with eager execution enabled and "
                    "with  experimental_use_pfor set to False.")
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

    def batch_jacobian(self, target, source,
                       unconnected_gradients=UnconnectedGradients.NONE,
                       parallel_iterations=None, experimental_use_pfor=True):
        """Computes and stacks per-example jacobians.

        Essentially ``tf.stack([self.jacobian(y[i], x[i]) for i in
        range(x.shape[0])])``, for a `target` whose ``target[i, ...]``
        depends only on ``source[i, ...]``.

        Note: Unless you set `persistent=True` a GradientTape can only be used
        to compute one set of gradients (or jacobians).

        Args:
          target: A tensor with rank 2 or higher and with shape
            [b, y1, ..., y_n]. `target[i,...]` should only depend on
            `source[i,...]`.
          source: A tensor with rank 2 or higher and with shape
            [b, x1, ..., x_m]. In eager mode fasttape also accepts a nested
            structure of such tensors (not in TF).
          unconnected_gradients: a value which can either hold 'none' or
            'zero' and alters the value which will be returned if the target
            and sources are unconnected. The possible values and effects are
            detailed in 'tf.UnconnectedGradients' and it defaults to 'none'.
          parallel_iterations: A knob to control how many iterations are
            dispatched in parallel (pfor and while_loop paths).
          experimental_use_pfor: If true, uses pfor for computing the
            Jacobian. Else uses a tf.while_loop.

        Returns:
          A tensor `t` with shape [b, y_1, ..., y_n, x1, ..., x_m] where
          `t[i, ...]` is the jacobian of `target[i, ...]` w.r.t.
          `source[i, ...]`, i.e. stacked per-example jacobians (for a nested
          `source`, a structure of such tensors).

        Raises:
          RuntimeError: If called on a used, non-persistent tape.
          RuntimeError: If called on a non-persistent tape with eager
            execution enabled and without enabling experimental_use_pfor.
          ValueError: If vectorization of jacobian computation fails or if
            first dimension of `target` and `source` do not match.

        Differences from TF: as jacobian(), eager batch jacobians of up to
        1024 rows run one backward pass per row instead of tracing pfor.
        """
        if self._tape is None:
            raise RuntimeError("A non-persistent GradientTape can only be used to"
                               "compute one set of gradients (or jacobians)"
                               + _USE_PERSISTENT)
        target_shape = target.shape
        loop = _use_loop(target, batch=True)
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
            if not experimental_use_pfor and not self._persistent:
                raise RuntimeError(
                    "GradientTape must be created with persistent=True"
                    " to compute the batch_jacobian with eager execution "
                    "enabled and  with experimental_use_pfor set to False.")
            with _errors_as_traced(experimental_use_pfor, "batch_jacobian"):
                [rows] = self._gradient_rows(target, [source],
                                             unconnected_gradients, batch=True)
            if rows is None:
                return array_ops.zeros(
                    target_shape.concatenate(source.shape[1:]), target.dtype)
            return rows
        if loop:
            # fasttape extension: a nest of sources (TF takes one tensor).
            flat = nest.flatten(source)
            with _errors_as_traced(experimental_use_pfor, "batch_jacobian"):
                rows = self._gradient_rows(target, flat, unconnected_gradients,
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
        with self._ensure_recording():
            with ops.control_dependencies(
                    [check_ops.assert_equal(batch_size, source_shape[0])]):
                target = array_ops.reshape(target, [batch_size, target_row_size])

        run_once = False

        def loop_fn(i):
            nonlocal run_once
            if run_once and not self._persistent:
                if parallel_iterations is not None:
                    raise RuntimeError(
                        "GradientTape must be created with persistent=True"
                        " to compute the batch_jacobian with parallel_iterations.")
                else:
                    raise RuntimeError(
                        "GradientTape must be created with persistent=True"
                        " to compute the batch_jacobian.")
            run_once = True
            with self._ensure_recording():
                y = array_ops.gather(target, i, axis=1)
            return self.gradient(y, source,
                                 unconnected_gradients=unconnected_gradients)

        if experimental_use_pfor:
            output = _pfor(loop_fn, target_row_size, parallel_iterations,
                           "batch_jacobian")
        else:
            if context.executing_eagerly() and not self._persistent:
                raise RuntimeError(
                    "GradientTape must be created with persistent=True"
                    " to compute the batch_jacobian with eager execution "
                    "enabled and  with experimental_use_pfor set to False.")
            output = pfor_ops.for_loop(
                loop_fn, _source_dtype(source, target.dtype), target_row_size,
                parallel_iterations=parallel_iterations)
        new_shape = array_ops.concat([target_shape, source_shape[1:]], axis=0)
        if output is None:
            return array_ops.zeros(new_shape, target.dtype)
        output = array_ops.reshape(output, [target_row_size, batch_size, -1])
        output = array_ops.transpose(output, [1, 0, 2])
        return array_ops.reshape(output, new_shape)


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
    return dtype.base_dtype


def _use_loop(target, batch=False):
    """Eager Jacobians of up to _LOOP_MAX_ROWS rows run as that many backward
    passes over the recorded trace: no tracing, no pfor rewrite, a fixed cost
    per row. Larger or symbolic ones go through TF's pfor, as in TF."""
    if not context.executing_eagerly() or not isinstance(target, ops.EagerTensor):
        return False
    shape = target.shape
    if not shape.is_fully_defined() or (batch and shape.rank < 2):
        return False
    rows = shape.num_elements()
    if batch:
        rows //= max(shape[0], 1)
    return 0 < rows <= _LOOP_MAX_ROWS


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


def _vlog_untrainable(what, t):
    logging.vlog(
        1, f"The dtype of the {what} tensor must be "
        "floating (e.g. tf.float32) when calling GradientTape.gradient, "
        "got %r", t.dtype)


def _check_tensors(flat, what):
    """TF fails on a non-tensor target or source with Python's
    AttributeError (reading its dtype or _id); fasttape adds what to do."""
    for t in flat:
        for attr in ("dtype", "_id"):
            try:
                getattr(t, attr)
            except AttributeError as exc:
                hint = (". Sources must be tensors or Variables: convert a "
                        "NumPy array or Python number with x = tf.constant(a) "
                        "and call tape.watch(x) before computing the target "
                        "from x" if what == "sources" else
                        ". Targets must be tensors (or Variables) computed "
                        "while the tape recorded")
                raise AttributeError(str(exc) + hint) from None
