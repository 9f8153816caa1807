"""Parity of every method and argument of tf.GradientTape.

Each case is one body ``case(GradientTape)`` run under tf.GradientTape and
fasttape.GradientTape by ``assert_parity``. Cases that must succeed under TF
use ``allow_tf_error=False``; cases where TF must raise check the exception
type TF raised too (``expect_error``), so a case cannot silently pass because
both implementations broke in the same way.

Where a case needs to look at a step that raises in the middle of a sequence
(a second gradient call, an invalid argument followed by a retry), it uses
``attempt`` to turn the exception into ``("raised", TypeName)`` so that the
results before and after it are compared too.
"""

import collections
import contextlib

import numpy as np
import pytest
import tensorflow as tf
from absl import logging as absl_logging
from tensorflow.python.eager import backprop as tf_backprop
from tensorflow.python.platform import tf_logging

import fasttape
import fasttape.tape as ft_tape
import harness
from harness import Raised, assert_parity


# -- helpers ------------------------------------------------------------------

def attempt(fn, *args, **kwargs):
    """fn's result, or ("raised", exception type name)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compared by the harness
        return ("raised", type(exc).__name__)


def expect_error(case, exc_type, **kwargs):
    """Both implementations raise, and TF's exception is ``exc_type``."""
    expected = assert_parity(case, **kwargs)
    assert isinstance(expected, Raised), f"tf did not raise: {expected!r}"
    assert isinstance(expected.exc, exc_type), expected
    return expected


def ok(case, **kwargs):
    return assert_parity(case, allow_tf_error=False, **kwargs)




def captured_log_first_n():
    """Warnings logged by TF's backprop module and by fasttape.tape."""
    return harness.captured_log_first_n(tf_backprop.logging, ft_tape.logging)


def ragged_parts(rt):
    """A RaggedTensor as comparable parts (the harness compares tensors)."""
    if rt is None:
        return None
    return (type(rt).__name__, rt.flat_values, rt.nested_row_splits)


def slices_parts(s):
    assert isinstance(s, tf.IndexedSlices), type(s)
    return (s.indices, s.values,
            None if s.dense_shape is None else tf.convert_to_tensor(s.dense_shape))


# -- constructor ---------------------------------------------------------------

def test_default_tape_is_not_persistent():
    def case(GradientTape):
        x = tf.constant(3.0)
        with GradientTape() as t:
            t.watch(x)
            y = x * x
        first = t.gradient(y, x)
        second = attempt(t.gradient, y, x)
        return first, second, attempt(t.jacobian, y, x)

    r = ok(case)
    assert r[1] == ("raised", "RuntimeError")


def test_persistent_tape_allows_many_gradients():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = x * x
            z = tf.reduce_sum(y * x)
        return (t.gradient(y, x), t.gradient(z, x), t.gradient(z, y),
                t.gradient([y, z], x), t.jacobian(y, x))

    ok(case)


@pytest.mark.parametrize("watch_accessed", [True, False])
def test_watch_accessed_variables(watch_accessed):
    def case(GradientTape):
        v = tf.Variable(2.0)
        w = tf.Variable(5.0)
        with GradientTape(watch_accessed_variables=watch_accessed,
                          persistent=True) as t:
            t.watch(v)
            y = v * v
            z = w * w * w
        return (t.gradient(y, v), t.gradient(z, w),
                list(t.watched_variables()))

    ok(case)


def test_watch_accessed_variables_false_nested_in_true():
    def case(GradientTape):
        v = tf.Variable(2.0)
        with GradientTape() as outer:
            with GradientTape(watch_accessed_variables=False) as inner:
                y = v * 3.0
            g_inner = inner.gradient(y, v)
        return g_inner, outer.gradient(y, v), len(inner.watched_variables()), \
            len(outer.watched_variables())

    ok(case)


def test_non_trainable_variable_not_watched_automatically():
    def case(GradientTape):
        v = tf.Variable(2.0, trainable=False)
        u = tf.Variable(3.0, trainable=False)
        with GradientTape(persistent=True) as t:
            t.watch(u)
            y = v * u * 4.0
        return t.gradient(y, [v, u]), list(t.watched_variables())

    ok(case)


# -- watch -----------------------------------------------------------------------

def test_watch_single_tensor():
    def case(GradientTape):
        x = tf.constant([1.0, -2.0])
        with GradientTape() as t:
            t.watch(x)
            y = tf.reduce_sum(tf.exp(x))
        return t.gradient(y, x)

    ok(case)


def test_watch_variable_explicitly():
    def case(GradientTape):
        v = tf.Variable([1.0, 2.0])
        with GradientTape(watch_accessed_variables=False) as t:
            t.watch(v)
            y = tf.reduce_sum(v * v)
        return t.gradient(y, v), list(t.watched_variables())

    ok(case)


def test_watch_nested_structures():
    Pair = collections.namedtuple("Pair", "a b")

    def case(GradientTape):
        a = tf.constant(1.0)
        b = tf.constant([2.0, 3.0])
        c = tf.constant(4.0, tf.float64)
        v = tf.Variable(5.0)
        nest_in = {"a": a, "rest": (b, [c, v]), "pair": Pair(a, b)}
        with GradientTape(watch_accessed_variables=False,
                          persistent=True) as t:
            t.watch(nest_in)
            y = a * tf.reduce_sum(b) + tf.cast(c * c, tf.float32) + v * a
        return (t.gradient(y, nest_in), t.gradient(y, Pair(a, v)),
                list(t.watched_variables()))

    r = ok(case)
    assert isinstance(r[1], tuple) and type(r[1]).__name__ == "Pair"


def test_watch_ragged_tensor():
    def case(GradientTape):
        x = tf.ragged.constant([[1.0, 2.0], [3.0]])
        with GradientTape() as t:
            t.watch(x)
            y = x * x
        return ragged_parts(t.gradient(y, x))

    ok(case)


@pytest.mark.parametrize("make", [
    lambda: tf.constant([1, 2]),
    lambda: tf.constant(True),
    lambda: tf.constant("s"),
    lambda: tf.Variable(3),
    lambda: [tf.constant(1.0), tf.constant(2, tf.int64)],
], ids=["int32", "bool", "string", "int_variable", "mixed_list"])
def test_watch_non_float_warns(make):
    def case(GradientTape):
        with captured_log_first_n() as logs:
            x = make()
            with GradientTape() as t:
                t.watch(x)
        return logs

    logs = ok(case)
    assert logs and all("must be floating" in m for _, m in logs), logs


def test_watch_float_does_not_warn():
    def case(GradientTape):
        with captured_log_first_n() as logs:
            with GradientTape() as t:
                t.watch([tf.constant(1.0), tf.constant(1.0, tf.float16),
                         tf.constant(1.0, tf.float64),
                         tf.constant(1j, tf.complex64), tf.Variable(1.0)])
        return logs

    assert ok(case) == []


def test_watched_int_tensor_gives_none():
    def case(GradientTape):
        with captured_log_first_n():
            x = tf.constant([1, 2])
            with GradientTape(persistent=True) as t:
                t.watch(x)
                y = tf.cast(x, tf.float32) * 2.0
            return t.gradient(y, x), t.gradient(y, [x, y])

    ok(case)


@pytest.mark.parametrize("bad", [3.0, np.array([1.0]), None, [tf.constant(1.0), "x"]],
                         ids=["float", "ndarray", "None", "list_with_str"])
def test_watch_non_tensor_raises(bad):
    def case(GradientTape):
        with GradientTape() as t:
            t.watch(bad)

    expect_error(case, ValueError)


def test_watch_before_entering():
    def case(GradientTape):
        x = tf.constant(2.0)
        t = GradientTape()
        return attempt(t.watch, x), attempt(t.watch, tf.Variable(1.0))

    ok(case)


def test_watch_after_exit_then_gradient():
    def case(GradientTape):
        x = tf.constant(2.0)
        with GradientTape(persistent=True) as t:
            y = x * x
        t.watch(x)
        z = x * 3.0
        return t.gradient(y, x), t.gradient(z, x), t.gradient(x, x)

    ok(case)


def test_watch_after_op_misses_the_op():
    def case(GradientTape):
        x = tf.constant(2.0)
        with GradientTape(persistent=True) as t:
            y = x * x
            t.watch(x)
            z = x * y
        return t.gradient(z, x), t.gradient(y, x), t.gradient(z, y)

    ok(case)


# -- watched_variables ---------------------------------------------------------

def test_watched_variables_order_is_creation_order():
    def case(GradientTape):
        vs = [tf.Variable(float(i), name=f"v{i}") for i in range(4)]
        with GradientTape() as t:
            y = vs[3] * vs[1]
            y = y + vs[0] + vs[3]
            y = y + vs[2]
        return list(t.watched_variables())

    ok(case)


def test_watched_variables_type_and_lifecycle():
    def case(GradientTape):
        v = tf.Variable(1.0)
        w = tf.Variable(2.0)
        t = GradientTape()
        before = t.watched_variables()
        with t:
            y = v * 2.0
            during = t.watched_variables()
            z = y * w
        after_exit = t.watched_variables()
        g = t.gradient(z, [v, w])
        after_grad = t.watched_variables()
        return (type(before).__name__, len(before),
                type(during).__name__, list(during),
                list(after_exit), g,
                type(after_grad).__name__, list(after_grad))

    ok(case)


def test_watched_variables_with_watch_accessed_false():
    def case(GradientTape):
        v = tf.Variable(1.0)
        w = tf.Variable(2.0)
        with GradientTape(watch_accessed_variables=False) as t:
            y = v * w
            t.watch(w)
            y = y * w
        return list(t.watched_variables()), t.gradient(y, [v, w])

    ok(case)


def test_watched_variables_nested_tapes_and_reset():
    def case(GradientTape):
        v = tf.Variable(1.0)
        w = tf.Variable(2.0)
        with GradientTape(persistent=True) as outer:
            a = v * 1.0
            with GradientTape() as inner:
                b = w * 1.0
            first = list(outer.watched_variables())
            outer.reset()
            c = w * 3.0
        return (first, list(inner.watched_variables()),
                list(outer.watched_variables()),
                outer.gradient(c, [v, w]), outer.gradient(a + b, [v, w]))

    ok(case)


# -- stop_recording --------------------------------------------------------------

def test_stop_recording_ops_not_recorded():
    def case(GradientTape):
        x = tf.constant(3.0)
        v = tf.Variable(2.0)
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = x * x
            with t.stop_recording():
                z = y * x          # not recorded
                w = v * 5.0        # variable read not recorded either
                inner_watch = [len(t.watched_variables())]
            u = z + y * 2.0
        return (t.gradient(z, x), t.gradient(u, x), t.gradient(w, v),
                t.gradient(u, y), inner_watch)

    ok(case)


def test_stop_recording_tape_never_entered():
    def case(GradientTape):
        t = GradientTape()
        with t.stop_recording():
            pass

    expect_error(case, RuntimeError)


def test_stop_recording_after_exit():
    def case(GradientTape):
        x = tf.constant(1.0)
        with GradientTape() as t:
            t.watch(x)
        with t.stop_recording():
            pass

    expect_error(case, ValueError)


def test_stop_recording_on_consumed_tape():
    def case(GradientTape):
        x = tf.constant(1.0)
        with GradientTape() as t:
            t.watch(x)
            y = x * x
            g = t.gradient(y, x)
            r = attempt(lambda: t.stop_recording().__enter__())
        return g, r

    ok(case)


def test_stop_recording_inner_tape_only():
    def case(GradientTape):
        x = tf.constant(3.0)
        with GradientTape(persistent=True) as outer:
            outer.watch(x)
            with GradientTape(persistent=True) as inner:
                inner.watch(x)
                with inner.stop_recording():
                    y = x * x
                with outer.stop_recording():
                    z = x * x * x
            w = x + 1.0
        return (outer.gradient(y, x), inner.gradient(y, x),
                outer.gradient(z, x), inner.gradient(z, x),
                outer.gradient(w, x), inner.gradient(w, x))

    ok(case)


def test_tf_stop_gradient():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        v = tf.Variable([3.0, 4.0])
        with GradientTape() as t:
            t.watch(x)
            y = tf.reduce_sum(tf.stop_gradient(x * v) * x + x * v)
        return t.gradient(y, [x, v])

    ok(case)


# -- reset ---------------------------------------------------------------------------

@pytest.mark.parametrize("persistent", [False, True])
def test_reset_forgets_earlier_ops(persistent):
    def case(GradientTape):
        x = tf.constant(2.0)
        v = tf.Variable(3.0)
        with GradientTape(persistent=persistent) as t:
            t.watch(x)
            loss = x * x * v
            t.reset()
            loss2 = loss + x * v
            t.watch(x)
            loss3 = loss2 + x * 10.0
        return t.gradient(loss3, [x, v]), list(t.watched_variables())

    ok(case)


def test_reset_on_tape_not_recording():
    def case(GradientTape):
        t = GradientTape()
        r1 = attempt(t.reset)
        with t:
            pass
        r2 = attempt(t.reset)
        return r1, r2

    r = ok(case)
    assert r == (("raised", "ValueError"), ("raised", "ValueError"))


def test_reset_after_gradient_outside_context():
    def case(GradientTape):
        x = tf.constant(2.0)
        with GradientTape() as t:
            t.watch(x)
            y = x * x
        g1 = t.gradient(y, x)
        return g1, attempt(t.reset)

    ok(case)


# -- gradient: targets and sources ------------------------------------------------

def test_single_target_single_source():
    def case(GradientTape):
        x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        with GradientTape() as t:
            t.watch(x)
            y = tf.reduce_mean(tf.tanh(x @ x))
        return t.gradient(y, x)

    ok(case)


def test_nested_targets():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            a = x * x
            b = tf.sin(x)
            c = tf.reduce_sum(x)
        return (t.gradient([a, b], x), t.gradient({"a": a, "n": [b, (c,)]}, x),
                t.gradient((a, a), x), t.gradient([], x))

    ok(case)


def test_nested_sources_packed_like_sources():
    Point = collections.namedtuple("Point", "x y")

    def case(GradientTape):
        x = tf.constant(1.0)
        y = tf.constant([2.0, 3.0])
        v = tf.Variable(4.0)
        with GradientTape(persistent=True) as t:
            t.watch([x, y])
            z = x * tf.reduce_sum(y) * v
        return (t.gradient(z, {"x": x, "inner": {"y": y, "vs": [v]}}),
                t.gradient(z, (x, [y, (v,)])),
                t.gradient(z, [x, y, v]),
                t.gradient(z, Point(x, v)),
                t.gradient(z, []), t.gradient(z, {}))

    r = ok(case)
    assert type(r[3]).__name__ == "Point"


def test_duplicate_sources_and_targets():
    def case(GradientTape):
        x = tf.constant(2.0)
        with GradientTape() as t:
            t.watch(x)
            y = x * x
        return t.gradient([y, y, x], [x, x, y])

    ok(case)


@pytest.mark.parametrize("dtype", [tf.float16, tf.float64, tf.bfloat16,
                                   tf.complex64])
def test_dtypes(dtype):
    def case(GradientTape):
        x = tf.cast(tf.constant([0.5, 1.5]), dtype)
        with GradientTape() as t:
            t.watch(x)
            y = tf.reduce_sum(x * x * x)
        return t.gradient(y, x)

    ok(case)


# -- output_gradients ----------------------------------------------------------------

def test_output_gradients():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        v = tf.Variable(3.0)
        with GradientTape(persistent=True) as t:
            t.watch(x)
            a = x * x
            b = x * v
        return (t.gradient(a, x, output_gradients=tf.constant([2.0, -1.0])),
                t.gradient([a, b], [x, v],
                           output_gradients=[tf.constant([1.0, 0.5]),
                                             tf.constant([3.0, 3.0])]),
                t.gradient({"a": a, "b": b}, x,
                           output_gradients={"a": tf.constant([5.0, 5.0]),
                                             "b": tf.constant([1.0, -1.0])}),
                t.gradient(a, x, output_gradients=tf.Variable([1.0, 1.0])),
                t.gradient(a, x, output_gradients=np.array([7.0, 8.0], np.float32)),
                t.gradient(x, x, output_gradients=[tf.constant([4.0, 5.0])]),
                t.gradient(a, x, output_gradients=None))

    ok(case)


@pytest.mark.xfail(strict=True, reason=(
    "differs from TF (TF's behaviour is odd): TF hands a None output "
    "gradient to the gradient functions as None (here _MulGrad raises "
    "ValueError; where None gets aggregated TF aborts the process with "
    "'Check failed: gradient_tensors[i] != Py_None'); fasttape silently "
    "substitutes ones for it"))
def test_output_gradients_with_none_entry():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        with GradientTape() as t:
            t.watch(x)
            a = x * x
            b = x * 2.0
        return t.gradient([a, b], x,
                          output_gradients=[None, tf.constant([1.0, 2.0])])

    expect_error(case, ValueError)


def test_output_gradients_wrong_count_fasttape_only():
    # Not a parity case: with fewer output gradients than targets TF 2.21
    # segfaults, and extra ones are silently ignored. fasttape raises.
    x = tf.constant([1.0, 2.0])
    with fasttape.GradientTape(persistent=True) as t:
        t.watch(x)
        a = x * x
        b = x * 2.0
    with pytest.raises(ValueError):
        t.gradient([a, b], x, output_gradients=[tf.ones(2)])
    with pytest.raises(ValueError):
        t.gradient(a, x, output_gradients=[tf.ones(2), tf.ones(2)])
    np.testing.assert_allclose(
        t.gradient(a, x, output_gradients=[tf.ones(2)]).numpy(), [2.0, 4.0])


def test_output_gradients_wrong_shape():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        with GradientTape() as t:
            t.watch(x)
            a = tf.reduce_sum(x * x)
        return t.gradient(a, x, output_gradients=tf.constant([1.0, 2.0]))

    assert_parity(case)


# -- unconnected_gradients -------------------------------------------------------------

@pytest.mark.parametrize("mode", [tf.UnconnectedGradients.ZERO,
                                  tf.UnconnectedGradients.NONE, "zero", "none"])
def test_unconnected_gradients(mode):
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        unused = tf.constant([[3.0]], tf.float64)
        i = tf.constant([1, 2])
        v = tf.Variable([[1.0, 2.0, 3.0]])
        with captured_log_first_n():
            with GradientTape() as t:
                t.watch([x, unused, i])
                y = x * x
        return t.gradient(y, [x, unused, i, v], unconnected_gradients=mode)

    ok(case)


def test_unconnected_gradients_invalid_value():
    def case(GradientTape):
        x = tf.constant(1.0)
        with GradientTape() as t:
            t.watch(x)
            y = x * x
        return t.gradient(y, x, unconnected_gradients="zeros")

    expect_error(case, ValueError)


def test_invalid_unconnected_gradients_does_not_consume_tape():
    # TF validates unconnected_gradients before it consumes a non-persistent
    # tape, so the same tape still answers a corrected call.
    def case(GradientTape):
        x = tf.constant(1.0)
        with GradientTape() as t:
            t.watch(x)
            y = x * 3.0
        first = attempt(t.gradient, y, x, unconnected_gradients="bogus")
        return first, attempt(t.gradient, y, x)

    ok(case)


# -- special sources and targets ------------------------------------------------------

def test_sources_that_are_targets():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        v = tf.Variable(2.0)
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = x * 3.0
        return (t.gradient(x, x), t.gradient(y, y), t.gradient([y, x], [x, y]),
                t.gradient(y, [y, x]), t.gradient(v, v),
                t.gradient(x, x, output_gradients=tf.constant([4.0, 5.0])))

    ok(case)


def test_unwatched_source_that_is_target():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        with GradientTape() as t:
            pass
        return t.gradient(x, x)

    ok(case)


def test_integer_sources_give_none():
    def case(GradientTape):
        x = tf.constant([1, 2])
        f = tf.constant([1.0, 2.0])
        with captured_log_first_n():
            with GradientTape(persistent=True) as t:
                t.watch([x, f])
                y = tf.cast(x, tf.float32) * f
                k = x * 2
        return (t.gradient(y, [x, f]), t.gradient(k, x), t.gradient(y, x,
                unconnected_gradients="zero"), t.gradient(k, f))

    ok(case)


def test_variables_as_sources():
    def case(GradientTape):
        w = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
        b = tf.Variable([0.5, -0.5])
        x = tf.constant([[1.0, 1.0]])
        with GradientTape() as t:
            y = tf.reduce_sum(tf.nn.relu(x @ w + b))
        return t.gradient(y, {"w": w, "b": b})

    ok(case)


def test_variable_read_in_fast_path_ops():
    def case(GradientTape):
        w = tf.Variable([1.0, 2.0])
        x = tf.constant([[3.0, 4.0]])
        with GradientTape() as t:
            y = tf.reduce_sum(tf.nn.bias_add(x, w) * w + tf.multiply(x, w))
        return t.gradient(y, w)

    ok(case)


def test_indexed_slices_from_gather():
    def case(GradientTape):
        v = tf.Variable([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        with GradientTape(persistent=True) as t:
            a = tf.reduce_sum(tf.gather(v, [0, 2]))
            b = tf.reduce_sum(tf.gather(v, [2, 2, 1]) * 2.0)
            c = a + tf.reduce_sum(v)
            e = tf.reduce_sum(tf.nn.embedding_lookup(v, [1]))
        ga = t.gradient(a, v)
        gab = t.gradient(a + b, v)
        return (slices_parts(ga), type(gab).__name__, gab, t.gradient(c, v),
                slices_parts(t.gradient(e, v)))

    ok(case)


def test_indexed_slices_second_order():
    def case(GradientTape):
        v = tf.Variable([1.0, 2.0, 3.0])
        with GradientTape() as outer:
            with GradientTape() as inner:
                y = tf.reduce_sum(tf.gather(v, [0, 2]) ** 3)
            g = inner.gradient(y, v)
            z = tf.reduce_sum(tf.convert_to_tensor(g))
        return g, outer.gradient(z, v)

    ok(case)


def test_target_is_a_variable():
    def case(GradientTape):
        v = tf.Variable([1.0, 2.0])
        x = tf.constant(3.0)
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = v * x
        return (t.gradient(v, v), attempt(t.gradient, v, x),
                t.gradient([v, y], v), t.gradient(y, x))

    ok(case)


def test_target_none():
    def case(GradientTape):
        x = tf.constant(1.0)
        with GradientTape() as t:
            t.watch(x)
        return t.gradient(None, x)

    expect_error(case, TypeError)




@pytest.mark.parametrize("which", [
    "target_float", "target_list_none",
    "source_float", "source_none"])
def test_non_tensor_targets_and_sources(which):
    def case(GradientTape):
        x = tf.constant(1.0)
        with GradientTape() as t:
            t.watch(x)
            y = x * 2.0
        if which == "target_float":
            return t.gradient(3.0, x)
        if which == "target_list_none":
            return t.gradient([y, None], x)
        if which == "source_float":
            return t.gradient(y, [x, 2.0])
        return t.gradient(y, [x, None])

    assert_parity(case)


def test_unconnected_target():
    def case(GradientTape):
        x = tf.constant(1.0)
        z = tf.constant(4.0)
        with GradientTape() as t:
            t.watch(x)
            y = z * 2.0
        return t.gradient(y, x), t.watched_variables()

    ok(case)


def test_integer_target():
    def case(GradientTape):
        x = tf.constant([1.0, 5.0, 2.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            i = tf.argmax(x)
            r = tf.round(x)
        return t.gradient(i, x), t.gradient(r, x)

    ok(case)


# -- gradient call placement ------------------------------------------------------------

def test_second_gradient_on_non_persistent_tape():
    def case(GradientTape):
        x = tf.constant(2.0)
        with GradientTape() as t:
            t.watch(x)
            y = x * x
        t.gradient(y, x)
        return t.gradient(y, x)

    expect_error(case, RuntimeError)


def test_gradient_inside_persistent_context_warns():
    def case(GradientTape):
        x = tf.constant(2.0)
        with captured_log_first_n() as logs:
            with GradientTape(persistent=True) as t:
                t.watch(x)
                y = x * x * x
                g = t.gradient(y, x)
                g2 = t.gradient(g, x)  # the gradient ops were recorded
            g3 = t.gradient(y, x)
        return g, g2, g3, logs

    r = ok(case)
    assert len(r[3]) == 2 and "persistent" in r[3][0][1]


def test_gradient_inside_non_persistent_context():
    def case(GradientTape):
        x = tf.constant(2.0)
        with captured_log_first_n() as logs:
            with GradientTape() as t:
                t.watch(x)
                y = x * x * x
                g = t.gradient(y, x)
                z = x * 5.0  # the tape stopped recording at gradient()
                again = attempt(t.gradient, z, x)
        return g, again, logs

    ok(case)


def test_reentering_recording_tape():
    def case(GradientTape):
        with GradientTape() as t:
            with t:
                pass

    expect_error(case, ValueError)


def test_reentering_after_exit_continues_recording():
    def case(GradientTape):
        x = tf.constant(2.0)
        t = GradientTape(persistent=True)
        with t:
            t.watch(x)
            y = x * x
        z = y * 10.0          # not recorded
        with t:
            w = y * x
        return t.gradient(w, x), t.gradient(z, x), t.gradient(y, x)

    ok(case)


def test_exception_inside_context_stops_recording():
    def case(GradientTape):
        x = tf.constant(2.0)
        t = GradientTape(persistent=True)
        try:
            with t:
                t.watch(x)
                y = x * x
                raise KeyError("boom")
        except KeyError:
            pass
        z = y * x
        return t.gradient(y, x), t.gradient(z, x)

    ok(case)


# -- higher order ----------------------------------------------------------------------

def test_nested_tapes_second_and_third_derivative():
    def case(GradientTape):
        x = tf.constant(1.5)
        with GradientTape() as t3:
            t3.watch(x)
            with GradientTape() as t2:
                t2.watch(x)
                with GradientTape() as t1:
                    t1.watch(x)
                    y = tf.sin(x) * x * x
                d1 = t1.gradient(y, x)
            d2 = t2.gradient(d1, x)
        d3 = t3.gradient(d2, x)
        return d1, d2, d3

    ok(case)


def test_nested_tapes_with_variables():
    def case(GradientTape):
        v = tf.Variable([1.0, 2.0])
        with GradientTape() as outer:
            with GradientTape() as inner:
                y = tf.reduce_sum(tf.exp(v) * v)
            g = inner.gradient(y, v)
            z = tf.reduce_sum(g * g)
        return g, outer.gradient(z, v)

    ok(case)


def test_persistent_tape_differentiates_its_own_gradient():
    def case(GradientTape):
        x = tf.constant([0.5, 2.0])
        with captured_log_first_n():
            with GradientTape(persistent=True) as t:
                t.watch(x)
                y = tf.reduce_sum(x ** 3)
                g = t.gradient(y, x)
                h = tf.reduce_sum(g)
            return g, t.gradient(h, x), t.gradient(g, x)

    ok(case)


def test_outer_tape_not_watching_gives_none():
    def case(GradientTape):
        x = tf.constant(2.0)
        with GradientTape() as outer:
            with GradientTape() as inner:
                inner.watch(x)
                y = x * x
            g = inner.gradient(y, x)
        return g, outer.gradient(g, x)

    ok(case)


def test_hessian_via_jacobian_of_gradient():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0, 3.0])
        with GradientTape() as outer:
            outer.watch(x)
            with GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(x ** 3) + x[0] * x[1]
            g = inner.gradient(y, x)
        return outer.jacobian(g, x)

    ok(case)


# -- jacobian ------------------------------------------------------------------------------

@pytest.mark.parametrize("use_pfor", [True, False])
@pytest.mark.parametrize("persistent", [True, False])
def test_jacobian(use_pfor, persistent):
    def case(GradientTape):
        x = tf.constant([1.0, 2.0, 3.0])
        v = tf.Variable([[0.5], [1.5]])
        with GradientTape(persistent=persistent) as t:
            t.watch(x)
            y = tf.reshape(x[:2], [2, 1]) * v * tf.reduce_sum(x)
        return t.jacobian(y, {"x": x, "v": v}, experimental_use_pfor=use_pfor)

    if use_pfor or persistent:
        ok(case)
    else:
        expect_error(case, RuntimeError)


@pytest.mark.parametrize("use_pfor", [True, False])
@pytest.mark.parametrize("mode", ["none", "zero", tf.UnconnectedGradients.ZERO])
def test_jacobian_unconnected(use_pfor, mode):
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        unused = tf.constant([3.0, 4.0, 5.0])
        with GradientTape(persistent=True) as t:
            t.watch([x, unused])
            y = x * x
        return t.jacobian(y, [x, unused], unconnected_gradients=mode,
                          experimental_use_pfor=use_pfor)

    ok(case)


@pytest.mark.parametrize("use_pfor", [True, False])
def test_jacobian_parallel_iterations(use_pfor):
    def case(GradientTape):
        x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = tf.sin(x) @ x
        return t.jacobian(y, x, parallel_iterations=2,
                          experimental_use_pfor=use_pfor)

    ok(case)


def test_jacobian_scalar_target_and_consumed_tape():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        with GradientTape() as t:
            t.watch(x)
            y = tf.reduce_sum(x * x)
        j = t.jacobian(y, x)
        return j, attempt(t.jacobian, y, x), attempt(t.gradient, y, x)

    ok(case)


def test_jacobian_variable_with_gather():
    def case(GradientTape):
        v = tf.Variable([1.0, 2.0, 3.0])
        with GradientTape() as t:
            y = tf.gather(v, [2, 0]) ** 2
        return t.jacobian(y, v)

    ok(case)


def test_jacobian_invalid_unconnected_gradients():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = x * x
        return t.jacobian(y, x, unconnected_gradients="bogus",
                          experimental_use_pfor=False)

    expect_error(case, ValueError)


# -- batch_jacobian ------------------------------------------------------------------------

@pytest.mark.parametrize("use_pfor", [True, False])
def test_batch_jacobian(use_pfor):
    def case(GradientTape):
        x = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        w = tf.constant([[1.0, -1.0, 0.5], [2.0, 0.0, 1.0]])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = tf.tanh(x @ w * 0.1)
        return t.batch_jacobian(y, x, experimental_use_pfor=use_pfor)

    ok(case)


def test_batch_jacobian_non_persistent_pfor():
    def case(GradientTape):
        x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        with GradientTape() as t:
            t.watch(x)
            y = x * x * x
        return t.batch_jacobian(y, x), attempt(t.batch_jacobian, y, x)

    ok(case)


def test_batch_jacobian_mismatched_batch():
    def case(GradientTape):
        x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = tf.concat([x, x], axis=0)
        return t.batch_jacobian(y, x)

    expect_error(case, ValueError)


def test_batch_jacobian_rank_one():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = x * x
        return t.batch_jacobian(y, x)

    expect_error(case, ValueError)


def test_batch_jacobian_non_persistent_without_pfor():
    def case(GradientTape):
        x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        with GradientTape() as t:
            t.watch(x)
            y = x * x
        return t.batch_jacobian(y, x, experimental_use_pfor=False)

    expect_error(case, RuntimeError)


@pytest.mark.parametrize("use_pfor", [True, False])
def test_batch_jacobian_unconnected(use_pfor):
    def case(GradientTape):
        x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = tf.ones([2, 3]) * 2.0
        return (t.batch_jacobian(y, x, experimental_use_pfor=use_pfor),
                t.batch_jacobian(y, x, unconnected_gradients="zero",
                                 experimental_use_pfor=use_pfor))

    ok(case)


# -- TF's differentiation helpers ---------------------------------------------------------

def test_custom_gradient():
    @tf.custom_gradient
    def clip_grad(x):
        def grad(dy):
            return tf.clip_by_value(dy, -0.5, 0.5)
        return x * 1.0, grad

    @tf.custom_gradient
    def log1pexp(x):
        e = tf.exp(x)

        def grad(upstream):
            return upstream * (1 - 1 / (1 + e))
        return tf.math.log(1 + e), grad

    def case(GradientTape):
        x = tf.constant([-1.0, 0.0, 100.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = clip_grad(x * 3.0)
            z = log1pexp(x)
        return t.gradient(y, x), t.gradient(z, x), t.gradient(y * z, x)

    ok(case)


def test_custom_gradient_with_variables():
    v = None

    @tf.custom_gradient
    def scaled(x):
        y = x * v

        def grad(dy, variables=None):
            return dy * v * 2.0, [tf.reduce_sum(dy * x) * 3.0 for _ in variables]
        return y, grad

    def case(GradientTape):
        nonlocal v
        v = tf.Variable(2.0)
        x = tf.constant([1.0, 2.0])
        with GradientTape() as t:
            t.watch(x)
            y = tf.reduce_sum(scaled(x))
        return t.gradient(y, [x, v]), list(t.watched_variables())

    ok(case)


def test_custom_gradient_second_order():
    @tf.custom_gradient
    def cube(x):
        def grad(dy):
            return dy * 3.0 * x * x
        return x * x * x, grad

    def case(GradientTape):
        x = tf.constant(2.0)
        with GradientTape() as outer:
            outer.watch(x)
            with GradientTape() as inner:
                inner.watch(x)
                y = cube(x)
            g = inner.gradient(y, x)
        return g, outer.gradient(g, x)

    ok(case)


def test_recompute_grad():
    def case(GradientTape):
        v = tf.Variable([[0.5, -1.0], [2.0, 1.0]])

        @tf.recompute_grad
        def block(x):
            return tf.nn.relu(x @ v) * 2.0

        x = tf.constant([[1.0, 2.0]])
        with GradientTape() as t:
            t.watch(x)
            y = tf.reduce_sum(block(block(x)))
        return t.gradient(y, [x, v])

    ok(case)


def test_grad_pass_through():
    def case(GradientTape):
        x = tf.constant([1.4, 2.6])
        v = tf.Variable([0.3, 0.7])
        with GradientTape() as t:
            t.watch(x)
            y = tf.reduce_sum(tf.grad_pass_through(tf.round)(x * v) * x)
            z = tf.grad_pass_through(lambda a: v.assign(a))(x)
        return t.gradient(y + tf.reduce_sum(z), [x, v])

    ok(case)


# -- tf.function -----------------------------------------------------------------------------

def test_function_called_inside_tape():
    def case(GradientTape):
        v = tf.Variable([1.0, 2.0])

        @tf.function
        def f(x):
            return tf.reduce_sum(tf.sin(x) * v)

        x = tf.constant([0.5, 1.5])
        with GradientTape() as t:
            t.watch(x)
            y = f(x) * 2.0
        return t.gradient(y, [x, v])

    ok(case)


def test_function_called_inside_persistent_tape():
    def case(GradientTape):
        @tf.function
        def f(x):
            return tf.exp(x) * x

        x = tf.constant([0.5, 1.5])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            y = f(x)
            z = f(y)
        return t.gradient(y, x), t.gradient(z, x), t.gradient(z, y)

    ok(case)


def test_function_second_order_nested_tapes():
    def case(GradientTape):
        @tf.function
        def f(x):
            return tf.sin(x) * x * x

        x = tf.constant([0.5, 1.5])
        with GradientTape() as outer:
            outer.watch(x)
            with GradientTape() as inner:
                inner.watch(x)
                y = f(x)
            g = inner.gradient(y, x)
        return g, outer.gradient(g, x)

    ok(case)


def test_function_second_order_persistent_tape():
    def case(GradientTape):
        @tf.function
        def f(x):
            return x * x * x

        x = tf.constant(2.0)
        with captured_log_first_n():
            with GradientTape(persistent=True) as t:
                t.watch(x)
                y = f(x)
                g = t.gradient(y, x)
            return g, t.gradient(g, x)

    ok(case)


def test_function_computing_gradient_inside():
    def case(GradientTape):
        @tf.function
        def grad_of(x):
            with GradientTape() as t:
                t.watch(x)
                y = x * x * x
            return t.gradient(y, x)

        x = tf.constant([1.0, 2.0])
        with GradientTape() as outer:
            outer.watch(x)
            g = grad_of(x)
        return g, outer.gradient(g, x)

    ok(case)


def test_tape_inside_function():
    def case(GradientTape):
        v = tf.Variable([1.0, -1.0])

        @tf.function
        def step(x):
            with GradientTape(persistent=True) as t:
                t.watch(x)
                y = tf.reduce_sum(tf.square(x * v))
            return t.gradient(y, [x, v]), t.gradient(y, x,
                                                     unconnected_gradients="zero")

        return step(tf.constant([2.0, 3.0]))

    ok(case)


def test_tape_inside_function_with_cond():
    def case(GradientTape):
        @tf.function
        def f(x, flag):
            with GradientTape() as t:
                t.watch(x)
                y = tf.cond(flag, lambda: x * x * x, lambda: tf.sin(x))
            return t.gradient(y, x)

        x = tf.constant([0.5, 2.0])
        return f(x, tf.constant(True)), f(x, tf.constant(False))

    ok(case)


def test_tape_inside_function_with_while_loop():
    def case(GradientTape):
        v = tf.Variable(1.1)

        @tf.function
        def f(x):
            with GradientTape() as t:
                t.watch(x)
                _, y = tf.while_loop(lambda i, y: i < 4,
                                     lambda i, y: (i + 1, y * x * v),
                                     (tf.constant(0), tf.constant(1.0)))
            return t.gradient(y, [x, v])

        return f(tf.constant(1.5))

    ok(case)


def test_tape_inside_function_python_loop_and_second_order():
    def case(GradientTape):
        @tf.function
        def f(x):
            with GradientTape() as outer:
                outer.watch(x)
                with GradientTape() as inner:
                    inner.watch(x)
                    y = x
                    for _ in range(3):
                        y = tf.tanh(y) * x
                g = inner.gradient(y, x)
            return g, outer.gradient(g, x)

        return f(tf.constant(0.7))

    ok(case)


def test_jacobian_inside_function():
    def case(GradientTape):
        @tf.function
        def f(x):
            with GradientTape(persistent=True) as t:
                t.watch(x)
                y = tf.sin(x) * x
            return (t.jacobian(y, x),
                    t.jacobian(y, x, experimental_use_pfor=False),
                    t.batch_jacobian(tf.reshape(y, [1, 3]),
                                     tf.reshape(x, [1, 3])))

        return f(tf.constant([1.0, 2.0, 3.0]))

    assert_parity(case)


def test_eager_control_flow_inside_tape():
    def case(GradientTape):
        x = tf.constant(1.5)
        with GradientTape() as t:
            t.watch(x)
            y = tf.cond(x > 1.0, lambda: x * x, lambda: x)
            _, z = tf.while_loop(lambda i, z: i < 3,
                                 lambda i, z: (i + 1, z * x),
                                 (tf.constant(0), y))
        return t.gradient(z, x)

    ok(case)


# -- copies, identity, ragged -------------------------------------------------------------

def test_identity_and_copies_same_device():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            a = tf.identity(x) * 2.0
            with tf.device("/CPU:0"):
                b = tf.identity(x * x)
            c = x._copy() * 3.0  # pylint: disable=protected-access
            d = tf.identity_n([x, a])[1]
        return (t.gradient(a, x), t.gradient(b, x), t.gradient(c, x),
                t.gradient(d, x), t.gradient([a, b, c, d], x))

    ok(case)


def test_ragged_sources():
    def case(GradientTape):
        x = tf.ragged.constant([[1.0, 2.0], [3.0], []])
        w = tf.constant(2.0)
        with GradientTape(persistent=True) as t:
            t.watch([x, w])
            y = x * x * w
            s = tf.reduce_sum(y)
        return (ragged_parts(t.gradient(y, x)), ragged_parts(t.gradient(s, x)),
                t.gradient(y, w), ragged_parts(t.gradient(s, {"r": x})["r"]))

    ok(case)


def test_ragged_unconnected_zero():
    def case(GradientTape):
        x = tf.ragged.constant([[1.0, 2.0], [3.0]])
        w = tf.constant(2.0)
        with GradientTape() as t:
            t.watch([x, w])
            y = w * 3.0
        g = t.gradient(y, [x, w], unconnected_gradients="zero")
        return ragged_parts(g[0]), g[1]

    # TF 2.21 itself fails here (ValueError: Shapes (3,) and (2,) are
    # incompatible, while rebuilding the ragged zeros): parity on the error.
    assert_parity(case)


# -- ops whose gradients accept None for some outputs --------------------------------------

def test_softmax_cross_entropy_second_order():
    def case(GradientTape):
        logits = tf.constant([[1.0, 2.0, 0.5], [0.1, 0.2, 3.0]])
        labels = tf.constant([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
        with GradientTape() as outer:
            outer.watch(logits)
            with GradientTape() as inner:
                inner.watch(logits)
                loss = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(
                    labels=labels, logits=logits))
                sparse = tf.reduce_sum(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(
                        labels=[1, 0], logits=logits))
            g = inner.gradient([loss, sparse], logits)
            z = tf.reduce_sum(g * g)
        return g, outer.gradient(z, logits)

    ok(case)


def test_fused_batch_norm():
    def case(GradientTape):
        x = tf.reshape(tf.range(24, dtype=tf.float32) / 10.0, [2, 2, 2, 3])
        scale = tf.Variable([1.0, 2.0, 0.5])
        offset = tf.Variable([0.0, 0.1, -0.1])
        with GradientTape() as t:
            t.watch(x)
            y, mean, var = tf.compat.v1.nn.fused_batch_norm(
                x, scale, offset, is_training=True)
            loss = tf.reduce_sum(y * y)
        return t.gradient(loss, [x, scale, offset])

    ok(case)


def test_py_function_inside_tape():
    def case(GradientTape):
        x = tf.constant([1.0, 2.0])
        with GradientTape() as t:
            t.watch(x)
            y = tf.py_function(lambda a: a * a * 3.0, [x], tf.float32)
        return t.gradient(y, x)

    ok(case)


# -- more corners: multi-output ops, composites, mixed tapes ----------------------------

def test_multi_output_ops_partially_used():
    def case(GradientTape):
        x = tf.constant([[3.0, 1.0, 2.0], [0.5, 4.0, -1.0]])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            vals, idx = tf.math.top_k(x, k=2)
            a, b, c = tf.split(x, 3, axis=1)
            u = tf.unstack(x)
            s, uu, vv = tf.linalg.svd(tf.matmul(x, x, transpose_b=True))
        return (t.gradient(vals, x), t.gradient(idx, x), t.gradient(b, x),
                t.gradient(u[1], x), t.gradient(s, x))

    ok(case)


def test_op_without_registered_gradient():
    def case(GradientTape):
        x = tf.constant([3.0, 1.0, 3.0])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            uniq, _ = tf.unique(x)
            y = tf.reduce_sum(uniq * 2.0)
        return (attempt(t.gradient, y, x),
                t.gradient(tf.reduce_sum(x), x))

    ok(case)


def test_function_with_unused_output():
    def case(GradientTape):
        @tf.function
        def f(x):
            return x * x, tf.sin(x), tf.cast(x, tf.int32)

        x = tf.constant([0.5, 1.5])
        with GradientTape(persistent=True) as t:
            t.watch(x)
            a, b, i = f(x)
        return t.gradient(a, x), t.gradient(b, x), t.gradient(i, x), \
            t.gradient([a, b], x)

    ok(case)


def test_function_gather_on_captured_variable():
    def case(GradientTape):
        v = tf.Variable([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])

        @tf.function
        def f(i):
            return tf.reduce_sum(tf.gather(v, i) ** 2)

        with GradientTape() as t:
            y = f(tf.constant([0, 2, 2]))
        g = t.gradient(y, v)
        return type(g).__name__, g, list(t.watched_variables())

    ok(case)


def test_tape_inside_function_gather_and_cond_on_variable():
    def case(GradientTape):
        v = tf.Variable([1.0, 2.0, 3.0])
        w = tf.Variable(2.0)

        @tf.function
        def f(flag):
            with GradientTape() as t:
                y = tf.cond(flag, lambda: tf.reduce_sum(tf.gather(v, [0, 1])) * w,
                            lambda: tf.reduce_sum(v) + w)
            return t.gradient(y, [v, w])

        gt, gf = f(tf.constant(True)), f(tf.constant(False))
        return [tf.convert_to_tensor(g) for g in gt], [tf.convert_to_tensor(g) for g in gf]

    ok(case)


def test_tape_inside_function_map_fn():
    def case(GradientTape):
        @tf.function
        def f(x):
            with GradientTape() as t:
                t.watch(x)
                y = tf.map_fn(lambda r: tf.reduce_sum(r * r), x)
            return t.gradient(y, x)

        return f(tf.constant([[1.0, 2.0], [3.0, 4.0]]))

    ok(case)


def test_watch_sparse_tensor():
    def case(GradientTape):
        sp = tf.sparse.SparseTensor([[0, 0], [1, 2]], [1.0, 2.0], [2, 3])
        with captured_log_first_n() as logs:
            with GradientTape() as t:
                t.watch(sp)
                y = tf.sparse.reduce_sum(sp * 3.0)
            g = t.gradient(y, sp)
        return (type(g).__name__, g.indices, g.values, g.dense_shape), logs

    assert_parity(case)


def test_variable_created_and_assigned_inside_tape():
    def case(GradientTape):
        x = tf.constant(2.0)
        with GradientTape(persistent=True) as t:
            t.watch(x)
            v = tf.Variable(x * 3.0)
            y = v * x
            v.assign_add(1.0)
            z = v * x
        return t.gradient([y, z], [x, v]), t.gradient(v, x), \
            list(t.watched_variables())

    ok(case)


def test_duplicate_variable_sources_and_mixed_precision():
    def case(GradientTape):
        v = tf.Variable([1.0, 2.0])
        with GradientTape() as t:
            y = tf.reduce_sum(tf.cast(v, tf.float16) * tf.constant(3.0, tf.float16))
        return t.gradient(y, [v, v, {"v": v}])

    ok(case)


def test_complex_to_real():
    def case(GradientTape):
        z = tf.constant([1.0 + 2.0j, -0.5 + 0.5j], tf.complex64)
        with GradientTape() as t:
            t.watch(z)
            y = tf.reduce_sum(tf.abs(z) ** 2 + tf.math.real(z * z))
        return t.gradient(y, z)

    ok(case)


def test_fasttape_outer_tf_inner_and_vice_versa():
    def case(GradientTape):
        x = tf.constant([0.5, 1.5])
        with GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(tf.sin(x) * x)
            g = inner.gradient(y, x)
        with tf.GradientTape() as outer2:
            outer2.watch(x)
            with GradientTape() as inner2:
                inner2.watch(x)
                y2 = tf.reduce_sum(tf.sin(x) * x)
            g2 = inner2.gradient(y2, x)
        return g, outer.gradient(g, x), g2, outer2.gradient(g2, x)

    ok(case)


def test_tf_stop_recording_context():
    from tensorflow.python.eager import record

    def case(GradientTape):
        x = tf.constant(3.0)
        with GradientTape(persistent=True) as t:
            t.watch(x)
            with record.stop_recording():
                y = x * x
                with GradientTape() as inner:
                    inner.watch(x)
                    z = x * 4.0
            w = y * x
        return t.gradient(y, x), t.gradient(w, x), inner.gradient(z, x)

    ok(case)


def test_keras_style_dense_layer_step():
    def case(GradientTape):
        tf.random.set_seed(0)
        w = tf.Variable(tf.random.stateless_normal([4, 3], seed=[1, 2]))
        b = tf.Variable(tf.zeros([3]))
        x = tf.random.stateless_normal([5, 4], seed=[3, 4])
        labels = tf.constant([0, 1, 2, 1, 0])
        with GradientTape() as t:
            logits = tf.nn.bias_add(tf.matmul(x, w), b)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=logits)) + 0.01 * tf.nn.l2_loss(w)
        return t.gradient(loss, [w, b])

    ok(case)


# -- logging channels --------------------------------------------------------------------

class _ListHandler(__import__("logging").Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def tensorflow_logger_records():
    """What reaches the 'tensorflow' logger (tf.get_logger()), with the
    log_first_n counters of tf_logging and absl.logging cleared so earlier
    tests cannot have used up a warning."""
    handler = _ListHandler()
    logger = tf.get_logger()
    saved = (dict(tf_logging._log_counter_per_token),  # pylint: disable=protected-access
             dict(absl_logging._log_counter_per_token))  # pylint: disable=protected-access
    tf_logging._log_counter_per_token.clear()  # pylint: disable=protected-access
    absl_logging._log_counter_per_token.clear()  # pylint: disable=protected-access
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        tf_logging._log_counter_per_token.update(saved[0])  # pylint: disable=protected-access
        absl_logging._log_counter_per_token.update(saved[1])  # pylint: disable=protected-access


def test_warnings_reach_tensorflow_logger():
    def case(GradientTape):
        with tensorflow_logger_records() as messages:
            x = tf.constant([1, 2])
            with GradientTape(persistent=True) as t:
                t.watch(x)
                f = tf.constant(1.0)
                t.watch(f)
                y = f * f
                t.gradient(y, f)
        return sorted({"floating" if "floating" in m else
                       "persistent" if "persistent" in m else "other"
                       for m in messages})

    assert ok(case) == ["floating", "persistent"]


def test_tape_inside_function_no_autograph_warnings():
    from tensorflow.python.autograph.impl import conversion
    from tensorflow.python.autograph.pyct import cache

    def case(GradientTape):
        # AutoGraph warns once per function, then remembers it in this cache.
        saved = conversion._ALLOWLIST_CACHE  # pylint: disable=protected-access
        conversion._ALLOWLIST_CACHE = cache.UnboundInstanceCache()  # pylint: disable=protected-access
        try:
            with tensorflow_logger_records() as messages:
                @tf.function
                def f(x):
                    with GradientTape() as t:
                        t.watch(x)
                        y = x * x
                    return t.gradient(y, x)

                g = f(tf.constant(3.0))
        finally:
            conversion._ALLOWLIST_CACHE = saved  # pylint: disable=protected-access
        return g, [m.split(" of <")[0] for m in messages if "AutoGraph" in m]

    ok(case)


# -- more corners: stop_recording interplay, graph-mode jacobians, handles ------------

def test_reset_and_stop_recording_inside_stop_recording():
    def case(G):
        x = tf.constant(2.0)
        with G(persistent=True) as t:
            t.watch(x)
            with t.stop_recording():
                r = attempt(t.reset)
                r2 = attempt(lambda: t.stop_recording().__enter__())
                w = x * 4.0
            y = x * x
        return t.gradient(y, x), t.gradient(w, x), r, r2

    ok(case)




@pytest.mark.parametrize("where", ["tape_stop_recording", "tf_stop_recording",
                                   "after_exit"])
def test_watch_while_no_tape_records(where):
    from tensorflow.python.eager import record

    def case(G):
        x = tf.constant(2.0)
        v = tf.Variable(3.0)
        t = G(persistent=True, watch_accessed_variables=False)
        if where == "after_exit":
            with t:
                pass
            t.watch([x, v])
            with t:
                y = x * x * v
        else:
            with t:
                stop = (t.stop_recording() if where == "tape_stop_recording"
                        else record.stop_recording())
                with stop:
                    t.watch([x, v])
                y = x * x * v
        return t.gradient(y, [x, v]), list(t.watched_variables())

    ok(case)


def test_watch_in_stop_recording_with_outer_tape_recording():
    # With another tape recording, TF's watch() does register.
    def case(G):
        x = tf.constant(2.0)
        v = tf.Variable(3.0)
        with G():
            with G(persistent=True, watch_accessed_variables=False) as t:
                with t.stop_recording():
                    t.watch([x, v])
                y = x * x * v
        return t.gradient(y, [x, v]), list(t.watched_variables())

    ok(case)


def test_gradient_inside_stop_recording_nonpersistent():
    def case(G):
        x = tf.constant(2.0)
        with G() as t:
            t.watch(x)
            y = x * x
            with t.stop_recording():
                g = t.gradient(y, x)
            t.watch(x)
            z = x * 3.0
        return g, attempt(t.gradient, z, x), attempt(t.gradient, z, x)
    ok(case)

def test_gradient_inside_stop_recording_persistent():
    def case(G):
        x = tf.constant(2.0)
        with G(persistent=True) as t:
            t.watch(x)
            y = x * x
            with t.stop_recording():
                g = t.gradient(y, x)
        return g, t.gradient(g, x)
    ok(case)

def test_jacobian_inside_context_nonpersistent():
    def case(G):
        x = tf.constant([1.0, 2.0])
        with G() as t:
            t.watch(x)
            y = x * x
            j = t.jacobian(y, x)
            r = attempt(t.gradient, y, x)
        return j, r
    ok(case)

def test_jacobian_nonpersistent_nopfor_in_function():
    def case(G):
        @tf.function
        def f(x):
            with G() as t:
                t.watch(x)
                y = x * x
            return t.jacobian(y, x, experimental_use_pfor=False)
        return f(tf.constant([1.0, 2.0]))
    assert_parity(case)

def test_batch_jacobian_nonpersistent_nopfor_in_function():
    def case(G):
        @tf.function
        def f(x):
            with G() as t:
                t.watch(x)
                y = x * x
            return t.batch_jacobian(y, x, experimental_use_pfor=False)
        return attempt(f, tf.constant([[1.0, 2.0], [3.0, 4.0]]))
    assert_parity(case)

def test_handle_as_source():
    def case(G):
        v = tf.Variable([1.0, 2.0])
        with G(persistent=True) as t:
            y = v * 2.0
        return t.gradient(y, v.handle), t.gradient(y, [v, v.handle])
    assert_parity(case)

def test_keras_variable_source():
    keras = pytest.importorskip("keras")
    def case(G):
        kv = keras.Variable([1.0, 2.0])
        x = tf.constant([3.0, 4.0])
        with G() as t:
            y = tf.reduce_sum(x * kv)
        return t.gradient(y, kv)
    ok(case)

def test_nontrainable_var_in_function():
    def case(G):
        v = tf.Variable(2.0, trainable=False)
        w = tf.Variable(3.0)
        @tf.function
        def f(x):
            return x * v * w
        with G() as t:
            y = f(tf.constant(1.0))
        return t.gradient(y, [v, w]), list(t.watched_variables())
    ok(case)

def test_jacobian_variable_target():
    def case(G):
        v = tf.Variable([1.0, 2.0])
        with G(persistent=True) as t:
            y = v * 1.0
        return t.jacobian(v, v), t.jacobian(y, v)
    assert_parity(case)

def test_gradient_of_while_v2_outside_function():
    def case(G):
        x = tf.constant(1.2)
        @tf.function
        def f(x):
            return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * x), (0, x))[1]
        with G(persistent=True) as t:
            t.watch(x)
            y = f(x)
            g = t.gradient(y, x)
        return y, g, t.gradient(g, x)
    ok(case)

def test_embedding_in_function_eager_tape():
    def case(G):
        v = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
        @tf.function
        def f(i):
            return tf.nn.embedding_lookup(v, i)
        with G() as t:
            y = tf.reduce_sum(f(tf.constant([1, 1])) * 2.0)
        g = t.gradient(y, v)
        return type(g).__name__, tf.convert_to_tensor(g)
    ok(case)

def test_sources_are_intermediate_ints_unconnected_zero():
    def case(G):
        x = tf.constant([1.0, 2.0])
        with G() as t:
            t.watch(x)
            i = tf.cast(x, tf.int32)
            y = tf.cast(i, tf.float32) * x
        return t.gradient(y, [x, i], unconnected_gradients='zero')
    ok(case)

def test_gradient_target_list_with_variable_and_output_grads():
    def case(G):
        v = tf.Variable([1.0, 2.0])
        with G() as t:
            y = v * 3.0
        return t.gradient([y, v], v, output_gradients=[tf.constant([1.0, 1.0]), tf.constant([5.0, 6.0])])
    ok(case)

def test_float64_variable_and_mixed():
    def case(G):
        v = tf.Variable([1.0, 2.0], dtype=tf.float64)
        x = tf.constant([1.0, 2.0], tf.float16)
        with G() as t:
            t.watch(x)
            y = tf.reduce_sum(v * tf.cast(x, tf.float64))
        return t.gradient(y, [v, x])
    ok(case)

def test_resource_gather_nd_and_scatter():
    def case(G):
        v = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
        with G() as t:
            y = tf.reduce_sum(tf.gather_nd(v, [[0, 1], [1, 0]]))
        g = t.gradient(y, v)
        return type(g).__name__, tf.convert_to_tensor(g)
    ok(case)

def test_second_order_indexed_slices_aggregation_with_dense():
    def case(G):
        v = tf.Variable([1.0, 2.0, 3.0])
        with G() as t:
            y = tf.reduce_sum(tf.gather(v, [0, 0, 2])) + tf.reduce_sum(v * v)
            z = tf.reduce_sum(tf.gather(v, [1]))
        g = t.gradient([y, z], v)
        return type(g).__name__, tf.convert_to_tensor(g)
    ok(case)
