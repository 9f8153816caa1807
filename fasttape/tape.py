"""fasttape.GradientTape: tf.GradientTape's API over fasttape's Cython core.

Every argument, result structure, warning and exception type follows
``tensorflow/python/eager/backprop.py`` (TF 2.21); only the bookkeeping and
the backward loop differ.
"""

import dataclasses

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
from fasttape.recording import _budget
from fasttape.recording import _recording
from fasttape.diagnostics import explain as _explain
from fasttape.recording._callback import is_trainable
from fasttape.backward import _gradient
from fasttape.backward import _jacobians
from fasttape.backward import _per_example
from fasttape.backward import _dp_replicas


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

    def __init__(self, persistent=False, watch_accessed_variables=True,
                 memory_budget=None):
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
          memory_budget: None, or the bytes (an int, or a string such as
            "512MB" or "2GiB") the tape may hold for the backward pass:
            beyond it, saved tensors that can be recomputed exactly are
            dropped and recomputed when the backward pass needs them (see
            docs/memory.md). None: the ``FASTTAPE_MEMORY_BUDGET``
            environment variable's value, else no budget.

        Raises:
          ValueError: if memory_budget is neither None, a number of bytes
            nor a size string.
        """
        self._tape = None
        self._persistent = persistent
        self._watch_accessed_variables = watch_accessed_variables
        self._watched_variables = ()
        self._recording = False
        self._memory_budget = (_budget.default_budget() if memory_budget is None
                               else _budget.parse_budget(memory_budget))
        self._budget_store = None
        # (method, ((source name, op types), ...)) of the last
        # per-example call: the sources it took per-example rows for
        self._per_example_rows = None
        self._per_example_rules = None

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
            if self._memory_budget is not None:
                self._tape.budget = _budget.Store(self._memory_budget)
                self._budget_store = self._tape.budget
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
                if self._tape.budget is not None:   # never dropped
                    self._tape.budget.watched.add(t._id)  # pylint: disable=protected-access
            _explain.note_watch(self._tape, _gradient.handle_or_self(t)._id)  # pylint: disable=protected-access

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
          variables; after per_example_gradients, per_example_norms or
          dp_gradient, the sources that call took per-example rows for (no
          op rule covers them) and the op types using them, and the rule
          (or rows) that covered each source (``per_example_rules``).
          ``print(tape.summary())`` shows it as a table.
        """
        result = _inspect_tape.summary(self._tape)
        if result.memory is None and self._budget_store is not None:
            # (A used-up tape: what its budget did.)
            result = dataclasses.replace(result,
                                         memory=self._budget_store.summary())
        if self._per_example_rows is not None:
            result = dataclasses.replace(result,
                                         per_example_rows=self._per_example_rows,
                                         per_example_rules=self._per_example_rules)
        return result

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
        # (The preparation in a method of its own: TF records the Python
        # stack, with the line of each frame, at every op it runs, and the
        # line of a frame costs more the further into its function it is:
        # the compiled pass's one op is called early in this function.)
        (tape_state, flat_targets, flat_sources, output_gradients,
         flat_sources_raw, unconnected_gradients,
         plain_sources) = self._prepare_gradient(target, sources,
                                                 output_gradients,
                                                 unconnected_gradients)
        explaining = _explain.enabled()
        try:
            flat_grad = _gradient.compute(
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
        flat_sources_raw = nest.map_structure(_gradient.handle_or_self, flat_sources_raw)
        flat_grad = composite_tensor_gradient.replace_flat_tensors_for_gradients(
            flat_sources_raw, flat_grad)
        return nest.pack_sequence_as(sources, flat_grad)

    def _prepare_gradient(self, target, sources, output_gradients,
                          unconnected_gradients):
        """gradient()'s checks, and its arguments made flat: (tape state,
        flat targets, flat sources, output gradients, flat sources as given,
        unconnected_gradients, the plain sources or None)."""
        if self._tape is None:
            raise RuntimeError(_gradient.CONSUMED)
        unconnected_gradients = _gradient.unconnected(unconnected_gradients)
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
            flat_targets = _handles(plain_targets)
            flat_sources_raw = plain_sources
            flat_sources = _handles(flat_sources_raw)
            trainable = is_trainable    # compiled; tensors only
        else:
            plain_sources = None
            trainable = backprop_util.IsTrainable   # TF's errors for non-tensors
            flat_targets = composite_tensor_gradient.get_flat_tensors_for_gradients(
                nest.flatten(target))
            flat_targets = nest.map_structure(_gradient.handle_or_self, flat_targets)
            flat_sources_raw = nest.flatten(sources)
            flat_sources = composite_tensor_gradient.get_flat_tensors_for_gradients(
                [_gradient.handle_or_self(t) for t in flat_sources_raw])
        for t in flat_targets:
            if not trainable(t):
                _gradient.vlog_untrainable("target", t)
        for t in flat_sources:
            if not trainable(t):
                _gradient.vlog_untrainable("source", t)
            if getattr(t, "is_packed", False):
                raise ValueError("GradientTape.gradient is not supported on "
                                 "packed EagerTensors yet.")
        if plain_sources is None:   # (eager tensors all, on the common path)
            _gradient.check_tensors(flat_targets, "target")
            _gradient.check_tensors(flat_sources, "sources")
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
        return (tape_state, flat_targets, flat_sources, output_gradients,
                flat_sources_raw, unconnected_gradients, plain_sources)

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
            raise RuntimeError(_gradient.CONSUMED)
        return _explain.explain(self._tape, target, sources)

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
        them. Through a grouped convolution, where TF's pfor is wrong, the
        rows run as a loop (eagerly at any size). See docs/differences.md.
        """
        return _jacobians.jacobian(self, target, sources, unconnected_gradients,
                                   parallel_iterations, experimental_use_pfor)

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
        1024 rows run one backward pass per row instead of tracing pfor,
        and through a grouped convolution a loop (TF's pfor is wrong there).
        """
        return _jacobians.batch_jacobian(self, target, source, unconnected_gradients,
                                         parallel_iterations, experimental_use_pfor)


    def per_example_gradients(self, losses, sources):
        """Each example's gradient (not in TF).

        Args:
          losses: a Tensor of shape [B], one loss per example, each
            depending only on its own example.
          sources: a Tensor/Variable or nested structure of them.

        Returns:
          A nested structure like `sources` of Tensors of shape
          ``[B] + source.shape`` (None for a source `losses` does not
          depend on): row i equals the gradient of ``losses[i]``.

        Raises:
          ValueError: if `losses` is not of shape [B], or mixes examples (an
            op on its path reduces over the batch axis).
          RuntimeError: on a used non-persistent tape (this call uses it up,
            as gradient() does).

        Inside tf.function (jit_compile too), on a tape recorded in the
        function, the same rules build their ops into the function.
        """
        return _per_example.per_example_gradients(self, losses, sources)

    def per_example_norms(self, losses, sources):
        """The L2 norm of each example's whole gradient (not in TF).

        Ops with a per-example rule (MatMul, BatchMatMul, BiasAdd, a bias or
        scale broadcast over the batch, Gather on a table) give their
        sources' norms from one backward pass, without building the
        gradients; other sources take one backward pass per example. See
        docs/privacy.md. Arguments and errors as per_example_gradients(),
        and ValueError for a source listed twice.

        Returns:
          A Tensor of shape [B].
        """
        return _per_example.per_example_norms(self, losses, sources)

    def dp_gradient(self, losses, sources, l2_norm_clip, noise_multiplier=0.0,
                    num_microbatches=None, seed=None):
        """The DP-SGD gradient, as TF Privacy's DP optimizers make it (not in TF).

        Each microbatch's gradient (by default each example's) is clipped to
        `l2_norm_clip`, the clipped gradients are summed, Gaussian noise of
        standard deviation ``l2_norm_clip * noise_multiplier`` is added and
        the sum divided by the number of microbatches.

        Args:
          losses: a Tensor of shape [B], one loss per example.
          sources: a Tensor/Variable or nested structure of them.
          l2_norm_clip: the clipping norm C (positive).
          noise_multiplier: the noise's standard deviation over C.
          num_microbatches: None (B: one example per microbatch), or a
            divisor of B; microbatch j holds examples j*B/m ... (j+1)*B/m - 1
            and its gradient is their mean's, as in TF Privacy.
          seed: None, an int or a pair of ints (inside tf.function, also an
            int tensor of either shape, or an int beside an int tensor or
            variable such as a step counter): the same seed gives the same
            noise. Inside tf.function the noise is TF's stateless normal,
            drawn afresh at each call when unseeded.

        Returns:
          A nested structure like `sources` of dense Tensors (None for a
          source `losses` does not depend on), ready for
          ``optimizer.apply_gradients``.

        Raises:
          ValueError: as per_example_gradients(), or for a source listed
            twice.
          tf.errors.InvalidArgumentError: for a num_microbatches that does
            not divide B, or a B of 0: eagerly and while tracing where B is
            known (then also a ValueError), else when the function runs.
          RuntimeError: as per_example_gradients().

        In a replica of a tf.distribute strategy (``strategy.run``), each
        replica clips its own examples (num_microbatches of them, if
        given; none from a replica whose shard is empty), the clipped sums
        are summed across replicas, the noise is added once and the
        division is by the global number of microbatches: every replica
        gets the gradient of the whole global batch (apply it without
        another cross-replica sum).
        """
        ctx = _dp_replicas.replica_context()
        if ctx is not None:
            return _dp_replicas.dp_gradient(
                ctx, self, losses, sources, l2_norm_clip, noise_multiplier,
                num_microbatches, seed)
        return _per_example.dp_gradient(self, losses, sources, l2_norm_clip,
                                        noise_multiplier, num_microbatches,
                                        seed)


_ResourceVariable = resource_variable_ops.ResourceVariable


def _handles(plain):
    """TF's _handle_or_self over what _plain_flat gives: a variable's
    handle, a tensor itself (without asking is_resource_variable of each)."""
    return [t if type(t) is ops.EagerTensor else t.handle for t in plain]


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
