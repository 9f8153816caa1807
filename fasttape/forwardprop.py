"""fasttape.ForwardAccumulator: tf.autodiff.ForwardAccumulator's API over
fasttape's core (direct JVP rules, else the transposed registered gradient;
no tf.function is traced per op type)."""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_shape
from tensorflow.python.ops import array_ops
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.platform import tf_logging as logging
from tensorflow.python.util import nest

from fasttape.recording import _recording

_DUPLICATE = ("Tensor {} was specified as a primal multiple times. This may "
              "indicate an error. If it was intended, please sum the "
              "corresponding tangents.")


def _broadcast_to_primal(tangent, primal):
    """A tangent whose shape broadcasts to its primal's (a scalar for a
    vector) stands for the same tangent at every element, as TF's
    elementwise JVPs treat it (``jvp(x * x) == 2 * x`` for a scalar tangent
    of 1): it is broadcast once here, so that every op's JVP sees it whole
    (TF's non-elementwise JVPs raise on it, or silently keep its shape).
    Any other shape is kept as given: TF does not check it when watching,
    and an op that cannot use it raises ValueError when it runs."""
    shape = primal.shape
    if shape.is_compatible_with(tangent.shape):
        return tangent
    try:
        both = array_ops.broadcast_static_shape(shape, tangent.shape)
    except ValueError:
        return tangent
    if both.rank != shape.rank or not both.is_compatible_with(shape):
        return tangent
    target = (shape.as_list() if shape.is_fully_defined()
              else array_ops.shape(primal))
    return array_ops.broadcast_to(tangent, target)


class ForwardAccumulator:
    """Computes Jacobian-vector products ("JVP"s) using forward-mode autodiff.

    A drop-in for ``tf.autodiff.ForwardAccumulator(primals, tangents)``:
    the same API, results and exception types.

    >>> x = tf.constant([1.0, 2.0])
    >>> with fasttape.ForwardAccumulator(x, tf.ones_like(x)) as acc:
    ...   y = x * x
    >>> print(acc.jvp(y))
    tf.Tensor([2. 4.], shape=(2,), dtype=float32)

    Differences from TF: the JVPs are computed eagerly by fasttape's
    forward rules (or by transposing an op's registered gradient) instead of
    in functions traced per op type; a tangent whose shape broadcasts to its
    primal's (a scalar) is used at every element. See docs/differences.md.
    """

    def __init__(self, primals, tangents):
        """Specify tensors to watch and their Jacobian-vector products.

        `tangents` right-multiplies the Jacobian of the function computed
        while this accumulator is active; since JVPs are computed in forward
        mode as the computation happens, it is supplied in advance.
        Excluding a tensor from `primals` is equivalent to watching it with
        a tangent of zeros.

        Args:
          primals: A tensor or nested structure of tensors to watch.
          tangents: A tensor or nested structure of tensors, with the same
            nesting structure as `primals`, each with the shape of its
            primal (or one that broadcasts to it).

        Raises:
          ValueError: If the same tensor or variable is specified multiple
            times in `primals`.
        """
        self._accumulator = _recording.AccumulatorState(use_batch=False)
        self._recording = False
        self._given = {}
        primal_ids = set()
        for primal in nest.flatten(primals):
            if id(primal) in primal_ids:
                raise ValueError(_DUPLICATE.format(primal))
            primal_ids.add(id(primal))
        self._watch(primals, tangents)

    def __enter__(self):
        self._push_accumulator()
        return self

    def __exit__(self, typ, value, traceback):
        if self._recording:
            self._pop_accumulator()

    def _push_accumulator(self):
        if self._recording:
            raise ValueError("Accumulator is already recording.")
        _recording.push_accumulator(self._accumulator)
        self._recording = True

    def _pop_accumulator(self):
        if not self._recording:
            raise ValueError("Accumulator is not recording.")
        _recording.pop_accumulator(self._accumulator)
        self._recording = False

    def _watch(self, primals, tangents):
        core = self._accumulator.core

        def _watch(primal, tangent):
            if not primal.dtype.is_floating:
                logging.log_first_n(
                    logging.WARN, "The dtype of the watched primal must be "
                    "floating (e.g. tf.float32), got %r", 5, primal.dtype)
            tangent = ops.convert_to_tensor(tangent, dtype=primal.dtype)
            given = tangent
            if not core.use_batch:
                tangent = _broadcast_to_primal(tangent, primal)
            if hasattr(primal, "handle"):
                primal = ops.convert_to_tensor(primal.handle)
            core.watch(primal._id, tangent)  # pylint: disable=protected-access
            if tangent is not given:
                # jvp(primal) gives back the tangent as given, as TF's does.
                self._given[primal._id] = (tangent, given)  # pylint: disable=protected-access
            # As TF's TFE_Py_ForwardAccumulatorWatch: the tangent goes when
            # the primal dies.
            self._accumulator.track((primal,))

        nest.map_structure(_watch, primals, tangents)

    def jvp(self, primals, unconnected_gradients=UnconnectedGradients.NONE):
        """Fetches the Jacobian-vector product computed for `primals`.

        This performs no computation: it looks up the JVP computed while the
        accumulator was active.

        Args:
          primals: A watched Tensor or structure of Tensors to fetch the JVPs
            for.
          unconnected_gradients: A value which can either hold 'none' or
            'zero' and alters the value which will be returned if no JVP was
            computed for `primals`. The possible values and effects are
            detailed in 'tf.UnconnectedGradients' and it defaults to 'none'.

        Returns:
          Tensors with the same shapes and dtypes as `primals`, or None if no
          JVP is available.
        """
        unconnected_gradients = UnconnectedGradients(unconnected_gradients)
        if self._accumulator is None:
            raise ValueError("Called jvp() without first tracing anything.")
        core = self._accumulator.core

        def _fetch_jvp(tensor):
            if hasattr(tensor, "handle"):
                unwrapped = ops.convert_to_tensor(tensor.handle)
            else:
                unwrapped = tensor
            result = core.fetch_jvp(unwrapped._id)  # pylint: disable=protected-access
            given = self._given.get(unwrapped._id)  # pylint: disable=protected-access
            if given is not None and result is given[0]:
                result = given[1]
            if result is None and unconnected_gradients == UnconnectedGradients.ZERO:
                result = array_ops.zeros_like(tensor)
            return result

        return nest.map_structure(_fetch_jvp, primals)

    @classmethod
    def _batch_accumulator(cls, primals, tangents):
        """An accumulator whose tangents carry a leading batch dimension: one
        forward pass pushes every column of a Jacobian at once."""
        acc = super().__new__(cls)
        acc._recording = False
        acc._given = {}
        acc._accumulator = _recording.AccumulatorState(use_batch=True)
        primal_ids = set()
        for primal, tangent in zip(nest.flatten(primals), nest.flatten(tangents)):
            tangent.shape.assert_is_compatible_with(
                tensor_shape.TensorShape([None]) + primal.shape)
            if id(primal) in primal_ids:
                raise ValueError(_DUPLICATE.format(primal))
            primal_ids.add(id(primal))
        acc._watch(primals, tangents)
        return acc
