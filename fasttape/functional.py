"""Second-order helpers: Hessian-vector products and Hessians.

    fasttape.hvp(f, x, v)      H(x) @ v, forward-over-reverse (one pass)
    fasttape.hessian(f, x)     the full Hessian, shape x.shape + x.shape

``f`` maps ``x`` (a tensor, or a list/tuple of tensors passed as separate
arguments) to a scalar. No tf.function is traced: both run on fasttape's
eager tape, so repeated calls cost the same as the first.
"""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.framework import ops
from tensorflow.python.ops import array_ops
from tensorflow.python.util import nest

from fasttape.forwardprop import ForwardAccumulator
from fasttape.tape import GradientTape


def _call(f, primals):
    if isinstance(primals, (list, tuple)):
        return f(*primals)
    return f(primals)


def hvp(f, primals, tangents):
    """Hessian of scalar ``f`` at ``primals`` times ``tangents`` (same
    structure as ``primals``), by forward-mode over reverse-mode."""
    primals = nest.map_structure(ops.convert_to_tensor, primals)
    with ForwardAccumulator(primals, tangents) as acc:
        with GradientTape() as tape:
            tape.watch(primals)
            y = _call(f, primals)
        grads = tape.gradient(y, primals)
    return acc.jvp(grads)


def hessian(f, x):
    """Full Hessian of scalar ``f`` at the tensor ``x``: the Jacobian of the
    gradient (reverse over reverse), shape ``x.shape + x.shape``."""
    x = ops.convert_to_tensor(x)
    with GradientTape() as outer:
        outer.watch(x)
        with GradientTape() as inner:
            inner.watch(x)
            y = _call(f, x)
        g = inner.gradient(y, x)
    h = outer.jacobian(g, x)
    if h is None:
        return array_ops.zeros(x.shape.concatenate(x.shape), x.dtype)
    return h
