"""The judge where fasttape and TF disagree: float64 central differences.

``central_difference(f, xs)`` is the oracle: the Jacobian of a NumPy
function of float64 arrays, one array per input, shaped
``f(xs).shape + x.shape``. ``jvp_oracle`` and ``vjp_oracle`` contract it
with a tangent or a cotangent.

``tf_wrong_here(case, oracle)`` is the one helper for "TF is wrong here":
the case (``case(ForwardAccumulator, GradientTape)``, like the forward-mode
parity cases) must give the oracle's values under fasttape, and must still
be wrong under TF (raise ``tf_raises``, or give values the oracle refutes),
so that the test fails the day TF is fixed and the README's list of
differences needs updating.
"""

import numpy as np
import tensorflow as tf

import fasttape
import harness
from harness import Raised

CLASSES = {
    "tf": (tf.autodiff.ForwardAccumulator, tf.GradientTape),
    "fasttape": (fasttape.ForwardAccumulator, fasttape.GradientTape),
}


def central_difference(f, xs, eps=1e-6):
    """Jacobians of ``f`` at ``xs`` (float64), one per input:
    ``J[i][..., j] = d f(xs)[...] / d xs[i][j]``."""
    xs = [np.array(x, dtype=np.float64) for x in xs]
    out_shape = np.shape(f(*xs))
    jacobians = []
    for i, x in enumerate(xs):
        jac = np.zeros(out_shape + x.shape)
        for j in np.ndindex(*x.shape):
            plus = [v.copy() for v in xs]
            minus = [v.copy() for v in xs]
            plus[i][j] += eps
            minus[i][j] -= eps
            jac[(Ellipsis,) + j] = (np.asarray(f(*plus), dtype=np.float64)
                                    - np.asarray(f(*minus), dtype=np.float64)
                                    ) / (2 * eps)
        jacobians.append(jac)
    return jacobians


def vjp_oracle(f, xs, cotangent=None, eps=1e-6):
    """Gradient of ``sum(cotangent * f(xs))`` w.r.t. each x (cotangent
    defaults to ones), as a reverse pass with that output gradient gives."""
    jacobians = central_difference(f, xs, eps)
    results = []
    for x, jac in zip(xs, jacobians):
        out_rank = jac.ndim - np.ndim(x)
        ct = (np.ones(jac.shape[:out_rank]) if cotangent is None
              else np.asarray(cotangent, dtype=np.float64))
        results.append(np.tensordot(ct, jac, axes=out_rank))
    return results


def jvp_oracle(f, xs, tangents, eps=1e-6):
    """Directional derivative of ``f`` at ``xs`` along ``tangents``."""
    xs = [np.array(x, dtype=np.float64) for x in xs]
    plus = [x + eps * np.asarray(t, dtype=np.float64) for x, t in zip(xs, tangents)]
    minus = [x - eps * np.asarray(t, dtype=np.float64) for x, t in zip(xs, tangents)]
    return (np.asarray(f(*plus)) - np.asarray(f(*minus))) / (2 * eps)


def run(case, impl):
    """``case(ForwardAccumulator, GradientTape)`` under one implementation;
    an exception becomes ``Raised``."""
    try:
        return case(*CLASSES[impl])
    except Exception as exc:  # noqa: BLE001 - judged, never swallowed
        return Raised(exc)


def _numpy_leaves(result):
    leaves = tf.nest.flatten(result, expand_composites=False)
    return [None if leaf is None else
            np.asarray(tf.convert_to_tensor(leaf).numpy(), dtype=np.float64)
            for leaf in leaves]


def matches(result, oracle, rtol, atol, none_as_zeros=False):
    """Does a result nest agree with the oracle's (a nest of arrays, None
    where no gradient is expected)? With ``none_as_zeros`` a None on either
    side stands for zeros of the other side's shape (an oracle computed by
    finite differences cannot tell an unconnected source from a zero
    gradient)."""
    if isinstance(result, Raised):
        return False
    got, want = _numpy_leaves(result), tf.nest.flatten(oracle)
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if none_as_zeros and (g is None) != (w is None):
            g = np.zeros(np.shape(w)) if g is None else g
            w = np.zeros(np.shape(g)) if w is None else w
        if (g is None) != (w is None):
            return False
        if g is not None and (g.shape != np.shape(w) or not np.allclose(
                g, w, rtol=rtol, atol=atol)):
            return False
    return True


def tf_wrong_here(case, oracle, *, tf_raises=None, rtol=1e-4, atol=1e-5):
    """TF is wrong here and fasttape right: fasttape's result must match the
    finite-difference ``oracle``; TF must raise ``tf_raises`` (an exception
    type) or, if ``tf_raises`` is None, give a result the oracle refutes.
    Returns (TF's result, fasttape's result)."""
    ft = run(case, "fasttape")
    if isinstance(ft, Raised):
        raise AssertionError(f"fasttape raised: {ft!r}") from ft.exc
    assert matches(ft, oracle, rtol, atol), (
        f"fasttape disagrees with finite differences: {ft!r} vs {oracle!r}")
    expected = run(case, "tf")
    if tf_raises is not None:
        assert isinstance(expected, Raised) and isinstance(
            expected.exc, tf_raises), (
                f"TF no longer raises {tf_raises.__name__} here (gave "
                f"{expected!r}): update the README's differences from TF")
    else:
        assert not isinstance(expected, Raised), (
            f"TF now raises {expected!r}: update the README's differences")
        assert not matches(expected, oracle, rtol, atol), (
            "TF now agrees with finite differences here: this is no longer a "
            "difference; update the README and turn this into a parity test")
    return expected, ft


def judge_results(expected, actual, oracle, rtol=1e-4, atol=1e-5,
                  none_as_zeros=False):
    """Sort an already computed pair (TF's result, fasttape's; each a nest
    or ``Raised``): "agree" when ``harness.assert_same`` accepts it, else by
    the oracle "fasttape wrong", "TF wrong" or "inconclusive" (both or
    neither match it, or no oracle). ``oracle`` is a nest of arrays, None
    (no oracle) or a callable returning one, called only on a
    disagreement."""
    try:
        harness.assert_same(expected, actual)
        return "agree"
    except AssertionError:
        pass
    if callable(oracle):
        oracle = oracle()
    if oracle is None:
        return "inconclusive"
    tf_ok = matches(expected, oracle, rtol, atol, none_as_zeros)
    ft_ok = matches(actual, oracle, rtol, atol, none_as_zeros)
    if ft_ok and not tf_ok:
        return "TF wrong"
    if tf_ok and not ft_ok:
        return "fasttape wrong"
    return "inconclusive"


def judge(case, oracle, rtol=1e-4, atol=1e-5, none_as_zeros=False):
    """Run ``case`` under both implementations and sort the pair
    (``judge_results``)."""
    return judge_results(run(case, "tf"), run(case, "fasttape"), oracle,
                         rtol, atol, none_as_zeros)
