"""Parity of fasttape.ForwardAccumulator with tf.autodiff.ForwardAccumulator:
the API, nesting with tapes and other accumulators, custom gradients,
tf.function, batched tangents.

A case is ``case(ForwardAccumulator, GradientTape)``; ``fwd_parity`` runs it
once with TF's pair of classes and once with fasttape's and compares the two
results with ``harness.assert_same`` (exceptions: same type). The op-by-op
cases are in test_forwardprop_ops.py, which reuses the adapter below.

Where TF itself raises, the case checks that fasttape raises the same type
(``fwd_error``); known fasttape bugs are strict xfails (markers below).
"""


import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import forwardprop as tf_forwardprop

import fasttape
import fasttape.forwardprop as ft_forwardprop
import harness
from harness import Raised

# TF's forward mode as in a fresh process (see conftest's fixture).
pytestmark = pytest.mark.usefixtures("fresh_tf_jvp_traces")

# Known fasttape bugs (strict: each marker fails as soon as its bug is fixed).


# -- the adapter -----------------------------------------------------------------

FWD_IMPLEMENTATIONS = {
    "tf": (tf.autodiff.ForwardAccumulator, tf.GradientTape),
    "fasttape": (fasttape.ForwardAccumulator, fasttape.GradientTape),
}


def run_fwd_case(case, impl):
    """case(ForwardAccumulator, GradientTape) under one implementation; an
    exception becomes Raised (compared by type)."""
    acc_cls, tape_cls = FWD_IMPLEMENTATIONS[impl]
    # patch() swaps module attributes: the TF side must really be TF's.
    assert (acc_cls.__module__.startswith("fasttape")
            == tape_cls.__module__.startswith("fasttape") == (impl == "fasttape"))
    try:
        return case(acc_cls, tape_cls)
    except Exception as exc:  # noqa: BLE001 - compared, never swallowed
        return Raised(exc)


def fwd_parity(case, rtol=None, atol=None, allow_tf_error=False):
    """Run ``case`` with TF's classes and with fasttape's, compare, return
    TF's result. Unless ``allow_tf_error``, TF must succeed."""
    return harness.compare(run_fwd_case(case, "tf"),
                           run_fwd_case(case, "fasttape"), rtol, atol,
                           allow_tf_error)


def fwd_error(case, exc_type):
    """Both raise, TF's exception is ``exc_type``, fasttape's the same type."""
    expected = fwd_parity(case, allow_tf_error=True)
    assert isinstance(expected, Raised), f"tf did not raise: {expected!r}"
    assert isinstance(expected.exc, exc_type), expected
    return expected


def attempt(fn, *args, **kwargs):
    """fn's result, or ("raised", exception type name): lets a case go on
    after a step that raises, so what comes after is compared too."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compared by the harness
        return ("raised", type(exc).__name__)


def const(*shape, seed=0, dtype=np.float32, low=None, high=None):
    rng = np.random.default_rng(seed)
    if low is None:
        value = rng.standard_normal(shape)
    else:
        value = rng.uniform(low, high, shape)
    return tf.constant(value.astype(dtype))


# -- nested structures, primals, tangents --------------------------------------

def test_single_primal_and_its_own_jvp():
    def case(FA, GT):
        x = const(3)
        v = const(3, seed=1)
        with FA(x, v) as acc:
            y = tf.sin(x) * x
        return y, acc.jvp(y), acc.jvp(x)
    fwd_parity(case)


def test_nested_structures_of_primals_and_tangents():
    def case(FA, GT):
        a, b, c, d = const(2, 3), const(3, seed=1), const(3, 2, seed=2), const(seed=3)
        primals = {"a": a, "rest": (b, [c, d])}
        tangents = {"a": const(2, 3, seed=4),
                    "rest": (const(3, seed=5), [const(3, 2, seed=6), const(seed=7)])}
        with FA(primals, tangents) as acc:
            y = tf.matmul(a * b, c) * d
            z = {"y": y, "pair": (tf.reduce_sum(b), [tf.tanh(c)])}
        return z, acc.jvp(z), acc.jvp(primals)
    fwd_parity(case)


def test_tangents_given_as_numpy_and_python_scalars():
    def case(FA, GT):
        x, y, s = const(3), const(2, 2, seed=1), const(seed=2)
        with FA([x, y, s], [np.arange(3, dtype=np.float32),
                            np.ones((2, 2), np.float32), 2.]) as acc:
            z = tf.reduce_sum(x) * y * s
        return acc.jvp(z)
    fwd_parity(case)


def test_tangent_given_as_python_list_is_a_structure():
    # nest sees [1., 2., 3.] as three leaves, not one tangent.
    def case(FA, GT):
        FA(const(3), [1., 2., 3.])
    fwd_error(case, ValueError)


def test_tuple_and_list_outputs_keep_their_type():
    def case(FA, GT):
        x = const(4)
        with FA(x, tf.ones(4)) as acc:
            outs = (tf.exp(x), [x * 2., (tf.square(x),)])
        return acc.jvp(outs)
    fwd_parity(case)


def test_primal_given_twice_raises_valueerror():
    def case(FA, GT):
        x = const(3)
        FA([x, x], [tf.ones(3), tf.ones(3)])
    fwd_error(case, ValueError)


def test_primal_given_twice_in_a_nest_raises_valueerror():
    def case(FA, GT):
        x, y = const(3), const(3)
        FA({"a": x, "b": (y, x)}, {"a": tf.ones(3), "b": (tf.ones(3), tf.ones(3))})
    fwd_error(case, ValueError)


def test_variable_given_twice_raises_valueerror():
    def case(FA, GT):
        v = tf.Variable([1., 2.])
        FA((v, v), (tf.ones(2), tf.ones(2)))
    fwd_error(case, ValueError)


def test_equal_but_distinct_primals_are_fine():
    def case(FA, GT):
        x, y = tf.constant([1., 2.]), tf.constant([1., 2.])
        with FA((x, y), (tf.ones(2), 2 * tf.ones(2))) as acc:
            z = x * y
        return acc.jvp(z)
    fwd_parity(case)


@pytest.mark.parametrize("primals,tangents", [
    ("list2", "list1"),
    ("list1", "tensor"),
    ("tensor", "list1"),
    ("dict", "list1"),
    ("dict", "dict_other_key"),
    ("tuple", "list2"),
])
def test_mismatched_structures_raise_like_tf(primals, tangents):
    def build(kind, x, y):
        return {"list2": [x, y], "list1": [x], "tensor": x, "dict": {"a": x},
                "dict_other_key": {"b": x}, "tuple": (x, y)}[kind]

    def case(FA, GT):
        x, y = const(2), const(2, seed=1)
        FA(build(primals, x, y), build(tangents, tf.ones(2), tf.ones(2)))
    fwd_error(case, (ValueError, TypeError))


def test_tangent_of_wrong_dtype_raises():
    def case(FA, GT):
        FA(const(2), tf.ones(2, tf.float64))
    fwd_error(case, (ValueError, TypeError))


def test_tangent_of_wrong_shape():
    # TF does not check the tangent's shape when watching; the mismatch shows
    # up (or not) in the ops that use it. A (1,) tangent for a (3,) primal
    # broadcasts: fasttape broadcasts it once when watching (the same tangent
    # at every element, right by finite differences), where TF's traced JVP
    # of x * 2. raises ValueError (see also test_reliability_forward.py).
    import fd
    x0 = np.array([0.5, -1.0, 2.0], np.float32)

    def case(FA, GT):
        x = tf.constant(x0)
        with FA(x, tf.ones([1])) as acc:
            y = x * 2.
        return acc.jvp(x), acc.jvp(y)
    fd.tf_wrong_here(case, [np.ones(1), np.full(3, 2.)], tf_raises=ValueError)


def test_primal_that_is_not_a_tensor_raises_like_tf():
    def case(FA, GT):
        FA(np.ones(2, np.float32), np.ones(2, np.float32))
    fwd_parity(case, allow_tf_error=True)


# -- jvp() -------------------------------------------------------------------

@pytest.mark.parametrize("unconnected", [
    tf.UnconnectedGradients.NONE, tf.UnconnectedGradients.ZERO, "none", "zero"])
def test_jvp_unconnected_gradients(unconnected):
    def case(FA, GT):
        x, w = const(3), const(2, 2, seed=1)
        outside = tf.sin(w)
        with FA(x, tf.ones(3)) as acc:
            y = tf.cos(x)
            unrelated = w * 3.
            int_out = tf.range(3)
        return acc.jvp([y, unrelated, outside, int_out, x],
                       unconnected_gradients=unconnected)
    fwd_parity(case)


def test_jvp_unconnected_gradients_invalid_string():
    def case(FA, GT):
        x = const(3)
        with FA(x, tf.ones(3)) as acc:
            y = tf.cos(x)
        return acc.jvp(y, unconnected_gradients="bogus")
    fwd_error(case, ValueError)


def test_jvp_of_tensor_computed_outside_the_accumulator_is_none():
    def case(FA, GT):
        x = const(3)
        acc = FA(x, tf.ones(3))
        before = x * 2.
        with acc:
            during = x * 3.
        after = x * 4.
        return (acc.jvp(before), acc.jvp(during), acc.jvp(after),
                acc.jvp(after, unconnected_gradients="zero"))
    fwd_parity(case)


def test_jvp_before_entering_gives_the_primal_tangent():
    def case(FA, GT):
        x = const(3)
        acc = FA(x, const(3, seed=2))
        return acc.jvp(x), acc.jvp(x * 2.)
    fwd_parity(case)


def test_jvp_of_none_and_python_values():
    def case(FA, GT):
        x = const(3)
        with FA(x, tf.ones(3)) as acc:
            y = x * 2.
        return attempt(acc.jvp, [y, None]), attempt(acc.jvp, 3.0)
    fwd_parity(case)


def test_reentering_a_recording_accumulator_raises_valueerror():
    def case(FA, GT):
        x = const(3)
        acc = FA(x, tf.ones(3))
        with acc:
            y = x * 2.
            with acc:
                pass
        return y
    fwd_error(case, ValueError)


def test_reentering_after_the_error_and_after_exit():
    def case(FA, GT):
        x = const(3)
        acc = FA(x, tf.ones(3))
        with acc:
            y = x * 2.
            raised = attempt(acc.__enter__)
            z = y * x          # still recording
        outside = z * 2.
        with acc:              # a second session of the same accumulator
            w = tf.sin(z)
        return raised, acc.jvp([y, z, outside, w])
    fwd_parity(case)


def test_pop_when_not_recording_raises_valueerror():
    def case(FA, GT):
        acc = FA(const(3), tf.ones(3))
        acc._pop_accumulator()  # pylint: disable=protected-access
    fwd_error(case, ValueError)


def test_exception_inside_the_block_stops_recording():
    def case(FA, GT):
        x = const(3)
        acc = FA(x, tf.ones(3))
        try:
            with acc:
                y = x * 2.
                raise KeyError("boom")
        except KeyError:
            pass
        z = x * 5.
        return acc.jvp(y), acc.jvp(z)
    fwd_parity(case)




def captured_forwardprop_warnings():
    """Warnings logged by TF's forwardprop module and fasttape.forwardprop."""
    return harness.captured_log_first_n(tf_forwardprop.logging,
                                        ft_forwardprop.logging)


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.bool, tf.complex64,
                                   tf.float16, tf.float64])
def test_non_float_primal_warns_like_tf(dtype):
    def case(FA, GT):
        x = tf.cast(tf.constant([1, 0, 2]), dtype)
        with captured_forwardprop_warnings() as records:
            with FA(x, tf.cast(tf.constant([1, 1, 1]), dtype)) as acc:
                y = tf.identity(x)
        return records, acc.jvp(x), acc.jvp(y)
    fwd_parity(case)


def test_integer_ops_have_no_jvp():
    def case(FA, GT):
        i = tf.constant([1, 2, 3])
        x = const(3)
        with FA((i, x), (tf.constant([1, 1, 1]), tf.ones(3))) as acc:
            j = i * 2 + 1
            f = tf.cast(i, tf.float32) * x
            k = tf.cast(x, tf.int32) + i
            idx = tf.argmax(x)
            g = tf.gather(x, j % 3)
        return acc.jvp([i, j, f, k, idx, g])
    fwd_parity(case)


def test_untracked_float_inputs_get_zero_tangents():
    def case(FA, GT):
        x = const(2, 3)
        c = const(3, seed=1)
        with FA(x, const(2, 3, seed=2)) as acc:
            y = tf.concat([x, c[None, :]], axis=0) * c
            z = tf.nn.softplus(y) + c
        return acc.jvp([y, z])
    fwd_parity(case)


def test_stop_gradient_and_stop_recording():
    def case(FA, GT):
        x = const(3)
        with FA(x, tf.ones(3)) as acc:
            a = tf.stop_gradient(x) * x
            with GT() as tape:
                with tape.stop_recording():
                    b = x * 3.
            c = x * 4.
        return acc.jvp([a, b, c])
    fwd_parity(case)


# -- variables as primals ----------------------------------------------------------

def test_variable_primal_passed_straight_into_ops():
    def case(FA, GT):
        v = tf.Variable([[1., 2.], [3., 4.]])
        x = const(2, 2, seed=1)
        with FA(v, const(2, 2, seed=2)) as acc:
            a = x * v
            b = tf.matmul(x, v)
            c = tf.reduce_sum(v, axis=0)
            d = v + 1.
            e = tf.nn.softplus(v)
            f = v.read_value()
            g = tf.convert_to_tensor(v)
        return [a, b, c, d, e, f, g], acc.jvp([a, b, c, d, e, f, g, v])
    fwd_parity(case)


def test_jvp_of_a_variable_primal():
    def case(FA, GT):
        v = tf.Variable([1., 2., 3.])
        w = tf.Variable(2.)
        acc = FA([v, w], [tf.constant([1., 0., 2.]), tf.constant(5.)])
        return acc.jvp([v, w]), acc.jvp(v.handle)
    fwd_parity(case)


def test_variable_and_tensor_primals_mixed_with_unwatched_variable():
    def case(FA, GT):
        v = tf.Variable(const(3, 2))
        u = tf.Variable(const(2, seed=3))   # not a primal
        x = const(4, 3, seed=1)
        with FA((x, v), (const(4, 3, seed=2), const(3, 2, seed=4))) as acc:
            y = tf.nn.bias_add(tf.matmul(x, v), u)
            loss = tf.reduce_mean(tf.square(y))
        return acc.jvp([y, loss, u])
    fwd_parity(case)


def test_variable_assigned_inside_the_accumulator():
    def case(FA, GT):
        v = tf.Variable([1., 2.])
        with FA(v, tf.constant([1., 1.])) as acc:
            before = v * 1.
            v.assign(v * 3.)
            after = v * 1.
            v.assign_add([1., 1.])
            later = v.read_value()
        return acc.jvp([before, after, later, v])
    fwd_parity(case)


def test_keras_dense_layer_kernel_jvp():
    # The docstring example of tf.autodiff.ForwardAccumulator.
    import tf_keras

    def case(FA, GT):
        tf_keras.utils.set_random_seed(0)
        x = tf.constant([[2.0, 3.0], [1.0, 4.0]])
        targets = tf.constant([[1.], [-1.]])
        dense = tf_keras.layers.Dense(1)
        dense.build([None, 2])
        with FA(dense.kernel, tf.constant([[1.], [0.]])) as acc:
            loss = tf.reduce_sum((dense(x) - targets) ** 2.)
        with FA(dense.bias, tf.constant([1.])) as acc_b:
            loss_b = tf.reduce_sum((dense(x) - targets) ** 2.)
        return acc.jvp(loss), acc_b.jvp(loss_b)
    fwd_parity(case)


# -- nesting -------------------------------------------------------------------------

def _cubic(x):
    return tf.reduce_sum(x ** 3 + tf.sin(x) * x[::-1])


def test_forward_over_reverse_hessian_vector_product():
    def case(FA, GT):
        x = const(3)
        v = const(3, seed=1)
        with FA(x, v) as acc:
            with GT() as tape:
                tape.watch(x)
                y = _cubic(x)
            g = tape.gradient(y, x)
        return g, acc.jvp(g), acc.jvp(y)
    result = fwd_parity(case)
    # The HVP is right, too (TF's own answer against the Hessian).
    x = const(3)
    with tf.GradientTape() as t2:
        t2.watch(x)
        with tf.GradientTape() as t1:
            t1.watch(x)
            y = _cubic(x)
        g = t1.gradient(y, x)
    hessian = t2.jacobian(g, x)
    np.testing.assert_allclose(result[1], tf.linalg.matvec(hessian, const(3, seed=1)),
                               rtol=1e-5)


def test_forward_over_reverse_with_variables_mlp():
    def case(FA, GT):
        w1 = tf.Variable(const(4, 5))
        b1 = tf.Variable(const(5, seed=1))
        w2 = tf.Variable(const(5, 1, seed=2))
        x = const(6, 4, seed=3)
        params = [w1, b1, w2]
        tangents = [const(4, 5, seed=4), const(5, seed=5), const(5, 1, seed=6)]
        with FA(params, tangents) as acc:
            with GT() as tape:
                h = tf.tanh(tf.matmul(x, w1) + b1)
                loss = tf.reduce_mean(tf.nn.softplus(tf.matmul(h, w2)))
            grads = tape.gradient(loss, params)
        return grads, acc.jvp(grads), acc.jvp(loss)
    fwd_parity(case, rtol=1e-4, atol=1e-6)


def test_reverse_over_forward():
    def case(FA, GT):
        x = const(3)
        v = const(3, seed=1)
        with GT(persistent=True) as tape:
            tape.watch([x, v])
            with FA(x, v) as acc:
                y = _cubic(x)
            jv = acc.jvp(y)
        return (jv, tape.gradient(jv, x), tape.gradient(jv, v),
                tape.gradient(y, x))
    fwd_parity(case)


def test_reverse_over_forward_jacobian_of_jvp():
    def case(FA, GT):
        x = const(2, 2)
        v = const(2, 2, seed=1)
        with GT() as tape:
            tape.watch(x)
            with FA(x, v) as acc:
                y = tf.matmul(x, x) + tf.nn.elu(x)
            jv = acc.jvp(y)
        return tape.jacobian(jv, x)
    fwd_parity(case)


def test_accumulator_inside_accumulator_second_order():
    def case(FA, GT):
        primal = tf.constant(1.1)
        with FA(primal, tf.constant(1.)) as outer:
            with FA(primal, tf.constant(1.)) as inner:
                out = primal ** tf.constant(3.5)
        inner_jvp = inner.jvp(out)
        return (inner_jvp, outer.jvp(inner_jvp), outer.jvp(out),
                inner.jvp(outer.jvp(out)))
    fwd_parity(case)


def test_accumulators_on_different_primals():
    def case(FA, GT):
        x, y = const(3), const(3, seed=1)
        vx, vy = const(3, seed=2), const(3, seed=3)
        with FA(x, vx) as outer:
            with FA(y, vy) as inner:
                z = tf.sin(x) * tf.exp(y) + x * y
        return (outer.jvp(z), inner.jvp(z), outer.jvp(inner.jvp(z)),
                inner.jvp(outer.jvp(z)))
    fwd_parity(case)


def test_third_order_with_three_accumulators():
    def case(FA, GT):
        x = tf.constant(0.7)
        with FA(x, tf.constant(1.)) as a1:
            with FA(x, tf.constant(1.)) as a2:
                with FA(x, tf.constant(1.)) as a3:
                    y = tf.sin(x) * x ** 2
        return (a3.jvp(y), a2.jvp(a3.jvp(y)), a1.jvp(a2.jvp(a3.jvp(y))),
                a1.jvp(a3.jvp(y)), a3.jvp(a1.jvp(y)))
    fwd_parity(case)


def test_accumulators_created_in_one_order_entered_in_the_other():
    def case(FA, GT):
        x = tf.constant(0.7)
        first = FA(x, tf.constant(1.))
        second = FA(x, tf.constant(2.))
        with second:
            with first:
                y = tf.sin(x) * x
        return (first.jvp(y), second.jvp(y), first.jvp(second.jvp(y)),
                second.jvp(first.jvp(y)))
    fwd_parity(case)


def test_tape_inside_accumulator_inside_tape():
    def case(FA, GT):
        x = const(3)
        v = const(3, seed=1)
        with GT(persistent=True) as outer:
            outer.watch(x)
            with FA(x, v) as acc:
                with GT() as inner:
                    inner.watch(x)
                    y = _cubic(x)
                g = inner.gradient(y, x)
            hvp = acc.jvp(g)
        return (g, hvp, outer.gradient(hvp, x), outer.gradient(g, x),
                outer.gradient(y, x))
    fwd_parity(case)


def test_tape_created_inside_accumulator_does_not_see_its_jvps():
    def case(FA, GT):
        x = const(3)
        v = const(3, seed=1)
        with FA(x, v) as acc:
            with GT(persistent=True) as tape:
                tape.watch([x, v])
                y = tf.sin(x) * x
            jy = acc.jvp(y)
        return (jy, tape.gradient(jy, x), tape.gradient(jy, v),
                tape.gradient(y, x))
    fwd_parity(case)


def test_tape_outside_sees_the_accumulators_jvps():
    def case(FA, GT):
        x = const(3)
        v = const(3, seed=1)
        with GT(persistent=True) as tape:
            tape.watch([x, v])
            with FA(x, v) as acc:
                y = tf.sin(x) * x
                jy = acc.jvp(y)
        return jy, tape.gradient(jy, x), tape.gradient(jy, v)
    fwd_parity(case)


def test_tape_created_before_but_first_entered_inside_the_accumulator():
    def case(FA, GT):
        x = const(3)
        v = const(3, seed=1)
        tape = GT(persistent=True)
        acc = FA(x, v)
        with acc:
            with tape:
                tape.watch([x, v])
                y = tf.sin(x) * x
        jy = acc.jvp(y)
        return jy, tape.gradient(jy, x), tape.gradient(jy, v)
    fwd_parity(case)


def test_persistent_tape_over_accumulator_many_gradients():
    def case(FA, GT):
        x = const(2, 3)
        v = const(2, 3, seed=1)
        with GT(persistent=True) as tape:
            tape.watch(x)
            with FA(x, v) as acc:
                y = tf.nn.softmax(x) * tf.nn.relu(x)
                s = tf.reduce_sum(y)
            jy, js = acc.jvp(y), acc.jvp(s)
        return (tape.gradient(s, x), tape.gradient(js, x),
                tape.gradient(jy, x), tape.gradient([js, s], x),
                tape.jacobian(jy, x))
    fwd_parity(case)


def test_forward_over_reverse_with_persistent_tape_and_jacobian():
    def case(FA, GT):
        x = const(3)
        v = const(3, seed=1)
        with FA(x, v) as acc:
            with GT(persistent=True) as tape:
                tape.watch(x)
                y = tf.sin(x) * tf.reduce_sum(x ** 2)
                s = tf.reduce_sum(y)
            g1 = tape.gradient(s, x)
            g2 = tape.gradient(y, x, output_gradients=tf.ones(3) * 2.)
        return g1, acc.jvp(g1), acc.jvp(g2)
    fwd_parity(case)


# -- custom_gradient, recompute_grad, tf.function -----------------------------------

@tf.custom_gradient
def _scaled_sin(x):
    y = tf.sin(x)

    def grad(dy):
        # Deliberately not the derivative: the JVP is the transposed grad.
        return dy * 3.0 * tf.cos(x)
    return y, grad


def test_custom_gradient_inside_accumulator():
    def case(FA, GT):
        x = const(4)
        with FA(x, const(4, seed=1)) as acc:
            y = _scaled_sin(x) * 2.
            z = tf.reduce_sum(_scaled_sin(y))
        return acc.jvp([y, z])
    fwd_parity(case)


def test_custom_gradient_with_variable_inside_accumulator():
    v = tf.Variable([1., 2., 3.])

    @tf.custom_gradient
    def f(x):
        y = x * v

        def grad(dy, variables=None):
            return dy * v * 2., [dy * x * 0.5 for _ in variables]
        return y, grad

    def case(FA, GT):
        x = const(3)
        with FA((x, v), (tf.ones(3), tf.constant([1., 0., -1.]))) as acc:
            y = f(x)
        return acc.jvp(y)
    fwd_parity(case)


# A custom gradient's backward under an accumulator. TF's accumulator has no
# forward function for a recorded custom gradient: it transposes the backward
# function, so it calls it (once per accumulator that records the op) and
# raises what it raises, even where the inner ops' JVPs have already given
# the outputs their tangents (those win). The cases count the calls.

class _BackwardFailed(Exception):
    """Raised by a custom backward asked to fail."""


def _counted_sin(calls, fail=False, connected=True):
    """A custom-gradient sin whose backward appends to ``calls`` and, if
    ``fail``, raises _BackwardFailed. Unconnected, the result reaches no
    inner JVP: its tangent is the transposed backward's."""
    @tf.custom_gradient
    def counted_sin(x):
        y = tf.sin(x) if connected else tf.stop_gradient(tf.sin(x))

        def grad(dy):
            calls.append(None)
            if fail:
                raise _BackwardFailed("raised by the custom backward")
            return dy * 3.0 * tf.cos(x)
        return y, grad
    return counted_sin


def _plain(FA, GT, f, x, v):
    with FA(x, v) as acc:
        y = f(x)
    return acc.jvp(y)


def _nested_accumulators(FA, GT, f, x, v):
    with FA(x, v) as outer:
        with FA(x, v * 2.) as inner:
            y = f(x)
        j = inner.jvp(y)
    return j, outer.jvp(y), outer.jvp(j)


def _accumulator_inside_tape(FA, GT, f, x, v):
    with GT() as tape:
        tape.watch(x)
        with FA(x, v) as acc:
            y = f(x)
        j = acc.jvp(y)
    return j, tape.gradient(j, x)


def _tape_inside_accumulator(FA, GT, f, x, v):
    with FA(x, v) as acc:
        with GT() as tape:
            tape.watch(x)
            y = f(x)
        g = tape.gradient(y, x)
    return acc.jvp(y), g, acc.jvp(g)


def _persistent_tape(FA, GT, f, x, v):
    with GT(persistent=True) as tape:
        tape.watch(x)
        with FA(x, v) as acc:
            y = f(x)
        j = acc.jvp(y)
    return j, tape.gradient(y, x), tape.gradient(j, x)


def _tf_function(FA, GT, f, x, v):
    g = tf.function(lambda t: f(t) * 2.)
    results = []
    for _ in range(2):  # traced, then the trace called again
        with FA(x, v) as acc:
            y = g(x)
        results.append(acc.jvp(y))
    return results


@pytest.mark.parametrize("connected", [True, False],
                         ids=["connected", "unconnected"])
@pytest.mark.parametrize("nesting", [
    _plain, _nested_accumulators, _accumulator_inside_tape,
    _tape_inside_accumulator, _persistent_tape, _tf_function],
    ids=lambda n: n.__name__.lstrip("_"))
def test_custom_gradient_backward_calls_in_forward_mode(nesting, connected):
    def case(FA, GT):
        calls = []
        result = nesting(FA, GT, _counted_sin(calls, connected=connected),
                         const(3), const(3, seed=1))
        return len(calls), result
    expected = fwd_parity(case)
    assert expected[0] >= 1, "TF never called the backward: the case tests nothing"


def test_custom_gradient_with_variable_backward_calls_in_forward_mode():
    v = tf.Variable([1., 2., 3.])

    def case(FA, GT):
        calls = []

        @tf.custom_gradient
        def f(x):
            def grad(dy, variables=None):
                calls.append(None)
                return dy * v * 2., [dy * x * 0.5 for _ in variables]
            return x * v, grad

        x = const(3)
        with FA(v, tf.constant([1., 0., -1.])) as acc:
            y = f(x)
        return len(calls), acc.jvp(y)
    assert fwd_parity(case)[0] == 1


def test_custom_backward_error_propagates_from_accumulator():
    def case(FA, GT):
        calls = []
        y = _plain(FA, GT, _counted_sin(calls, fail=True), const(3),
                   const(3, seed=1))
        return len(calls), y
    fwd_error(case, _BackwardFailed)


def test_custom_backward_whose_ops_have_no_gradient():
    """The transposition differentiates what the backward ran: an op there
    without a registered gradient raises LookupError, as in TF, though the
    forward's own JVP (x * 2) needs none."""
    def case(FA, GT):
        calls = []

        @tf.custom_gradient
        def f(x):
            def grad(dy):
                calls.append(None)
                return tf.raw_ops.SoftsignGrad(gradients=dy, features=x)
            return x * 2., grad

        x = const(3)
        with FA(x, const(3, seed=1)) as acc:
            y = f(x)
        return len(calls), acc.jvp(y)
    fwd_error(case, LookupError)

def test_custom_backward_error_in_persistent_tape():
    """Caught where it is raised, the tape and the accumulator go on: the
    failed op's outputs are not recorded (neither are they in TF's)."""
    def case(FA, GT):
        calls = []
        f = _counted_sin(calls, fail=True)
        x, v = const(3), const(3, seed=1)
        with GT(persistent=True) as tape:
            tape.watch(x)
            with FA(x, v) as acc:
                failed = attempt(f, x)
                z = tf.sin(x) * 2.
            jz = acc.jvp(z)
        return (failed, len(calls), jz, tape.gradient(z, x),
                tape.gradient(jz, x), attempt(_persistent_tape, FA, GT, f, x, v))
    expected = fwd_parity(case)
    assert expected[0] == expected[-1] == ("raised", "_BackwardFailed")


def test_custom_backward_error_on_a_second_thread():
    """The accumulator on a worker thread raises the backward's error while
    the main thread computes gradients with a tape."""
    def case(FA, GT):
        calls = []
        f = _counted_sin(calls, fail=True)
        started, done = threading.Event(), threading.Event()
        result = {}

        def jvp():
            started.wait(10)
            result["jvp"] = attempt(_plain, FA, GT, f, const(3), const(3, seed=1))
            done.set()

        worker = threading.Thread(target=jvp)
        worker.start()
        x = const(3, seed=2)
        steps = 0
        try:
            while not done.is_set() or steps < 3:
                with GT() as tape:
                    tape.watch(x)
                    y = tf.reduce_sum(tf.sin(x) * x)
                started.set()
                grad = tape.gradient(y, x)
                steps += 1
        finally:
            started.set()
            worker.join()
        return result["jvp"], len(calls), grad
    assert fwd_parity(case)[0] == ("raised", "_BackwardFailed")


def test_recompute_grad_inside_accumulator():
    def case(FA, GT):
        x = const(3)
        f = tf.recompute_grad(lambda t: tf.tanh(t) * t)
        with FA(x, const(3, seed=1)) as acc:
            y = f(x)
        return y, acc.jvp(y)
    # TF's recompute_grad refuses forward mode (its grad's transpose raises).
    fwd_error(case, NotImplementedError)


def test_tf_function_called_inside_accumulator():
    @tf.function
    def f(x, w):
        return tf.reduce_sum(tf.nn.softplus(tf.matmul(x, w)) * tf.sin(x[:, :1]), 0)

    def case(FA, GT):
        x, w = const(3, 4), const(4, 2, seed=1)
        f(x, w)  # traced outside the accumulator too
        with FA((x, w), (const(3, 4, seed=2), const(4, 2, seed=3))) as acc:
            y = f(x, w)
            y2 = f(x, w) * 2.
        return y, acc.jvp([y, y2])
    fwd_parity(case, rtol=1e-4)


def test_tf_function_reading_a_captured_variable_primal():
    v = tf.Variable([[1., 2.], [3., 4.]])

    @tf.function
    def f(x):
        return tf.matmul(x, v) + tf.exp(v)

    def case(FA, GT):
        x = const(1, 2)
        with FA(v, tf.constant([[1., 0.], [0., 1.]])) as acc:
            y = f(x)
        return y, acc.jvp(y)
    fwd_parity(case)


def test_tf_function_with_tape_inside_called_inside_accumulator():
    @tf.function
    def grad_of_cubic(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = _cubic(x)
        return tape.gradient(y, x)

    def case(FA, GT):
        x = const(3)
        with FA(x, const(3, seed=1)) as acc:
            g = grad_of_cubic(x)
        return g, acc.jvp(g)
    fwd_parity(case)


def test_accumulator_inside_tf_function_direct_rules():
    # Graph ops, attributes read from the op (padding, data_format as bytes).
    def case(FA, GT):
        @tf.function
        def f(x, v, w, b):
            with FA((x, w), (v, tf.ones_like(w))) as acc:
                h = tf.nn.conv2d(x, w, strides=2, padding="SAME")
                h = tf.nn.bias_add(h, b)
                y = tf.reduce_mean(tf.tanh(h) * tf.nn.relu(h), axis=[1, 2])
                z = tf.nn.log_softmax(y)
            return acc.jvp([h, y, z])
        return f(const(2, 5, 5, 3), const(2, 5, 5, 3, seed=1),
                 const(3, 3, 3, 4, seed=2), const(4, seed=3))
    fwd_parity(case, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fn", [tf.nn.softplus, tf.math.atan, lambda x: x ** 3,
                                lambda x: x[::-1], lambda x: tf.nn.softplus(x) * x],
                         ids=["Softplus", "Atan", "Pow", "StridedSlice", "Softplus_Mul"])
def test_accumulator_inside_tf_function_fallback_ops(fn):
    def case(FA, GT):
        @tf.function
        def f(x, v):
            with FA(x, v) as acc:
                y = fn(x)
            return acc.jvp(y)
        return f(const(3), const(3, seed=1))
    fwd_parity(case)


def test_accumulator_and_tape_inside_tf_function_hvp():
    def case(FA, GT):
        @tf.function
        def hvp(x, v):
            with FA(x, v) as acc:
                with GT() as tape:
                    tape.watch(x)
                    y = _cubic(x)
                g = tape.gradient(y, x)
            return g, acc.jvp(g)
        return hvp(const(3), const(3, seed=1))
    fwd_parity(case)


def test_tape_and_accumulator_inside_tf_function_reverse_over_forward():
    def case(FA, GT):
        @tf.function
        def f(x, v):
            with GT() as tape:
                tape.watch(x)
                with FA(x, v) as acc:
                    y = tf.reduce_sum(tf.math.atan(x) * x)
                jv = acc.jvp(y)
            return jv, tape.gradient(jv, x)
        return f(const(3), const(3, seed=1))
    fwd_parity(case)


def test_accumulator_inside_tf_function_with_variable_primal():
    def case(FA, GT):
        v = tf.Variable(const(3, 2))

        @tf.function
        def f(x):
            with FA(v, tf.ones([3, 2])) as acc:
                y = tf.matmul(x, v)
                z = x @ tf.tanh(v)
            return acc.jvp([y, z])
        return f(const(4, 3, seed=1))
    fwd_parity(case)


# -- batched tangents ---------------------------------------------------------------

def _elementwise(x):
    return tf.sin(x) * x + tf.exp(x) * tf.tanh(x) - tf.square(x)


def _elementwise_fallback(x):
    return tf.nn.softplus(x) * tf.math.atan(x)


@pytest.mark.parametrize("fn", [
    pytest.param(_elementwise, id="direct_rules"),
    pytest.param(_elementwise_fallback, id="fallback"),
])
def test_batch_accumulator_full_jacobian(fn):
    n = 4

    def case(FA, GT):
        x = const(n)
        with FA._batch_accumulator(x, tf.eye(n)) as acc:  # pylint: disable=protected-access
            y = fn(x)
        return acc.jvp(y)
    jac_fwd = fwd_parity(case)
    x = const(n)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    # Row i of the batched JVP is J e_i, a column of J.
    np.testing.assert_allclose(np.transpose(jac_fwd), tape.jacobian(y, x),
                               rtol=1e-5, atol=1e-6)


def test_batch_accumulator_two_primals():
    def case(FA, GT):
        x, y = const(3), const(3, seed=1)
        basis = tf.eye(6)
        with FA._batch_accumulator(  # pylint: disable=protected-access
                (x, y), (basis[:, :3], basis[:, 3:])) as acc:
            z = tf.sin(x) * y + x * x
        return acc.jvp(z)
    fwd_parity(case)


def test_batch_accumulator_with_a_constant_operand():
    # TF's batch mode gives untracked inputs unbatched zero tangents and fails
    # (ValueError). fasttape may do the same, or give the right Jacobian.
    x = const(3)
    c = const(3, seed=1)

    def case(FA, GT):
        with FA._batch_accumulator(x, tf.eye(3)) as acc:  # pylint: disable=protected-access
            y = x * c + 2.
        return acc.jvp(y)
    expected = run_fwd_case(case, "tf")
    assert isinstance(expected, Raised) and isinstance(expected.exc, ValueError)
    actual = run_fwd_case(case, "fasttape")
    if isinstance(actual, Raised):
        assert isinstance(actual.exc, ValueError), actual
    else:
        np.testing.assert_allclose(actual, tf.linalg.diag(c), rtol=1e-6)


def test_batch_accumulator_tangent_shape_is_checked():
    def case(FA, GT):
        x = const(3)
        FA._batch_accumulator(x, tf.ones([3]))  # pylint: disable=protected-access
    fwd_error(case, ValueError)


def test_batch_accumulator_duplicate_primal():
    def case(FA, GT):
        x = const(3)
        FA._batch_accumulator([x, x], [tf.eye(3), tf.eye(3)])  # pylint: disable=protected-access
    fwd_error(case, ValueError)


def test_batch_accumulator_jvp_of_primal_and_structure():
    def case(FA, GT):
        x = const(2)
        t = tf.constant([[1., 0.], [0., 1.], [1., 1.]])
        acc = FA._batch_accumulator({"x": x}, {"x": t})  # pylint: disable=protected-access
        return acc.jvp({"x": x}), type(acc).__name__
    fwd_parity(case)


# -- who sees whom: TF numbers tapes and accumulators on every push ---------------

def test_accumulator_reentered_inside_a_younger_one():
    def case(FA, GT):
        x = tf.constant(0.7)
        a = FA(x, tf.constant(1.))
        b = FA(x, tf.constant(2.))
        with a:
            pass
        with b:
            with a:
                y = tf.sin(x) * x
        return a.jvp(b.jvp(y)), b.jvp(a.jvp(y))
    fwd_parity(case)


def test_tape_reentered_inside_an_accumulator_no_longer_sees_its_jvps():
    def case(FA, GT):
        x, v = const(2), const(2, seed=1)
        tape = GT(persistent=True)
        with tape:
            tape.watch(x)
        with FA(x, v) as acc:
            with tape:
                y = tf.sin(x)
        jy = acc.jvp(y)
        return jy, tape.gradient(jy, x), tape.gradient(y, x)
    fwd_parity(case)


def test_stop_recording_inside_an_accumulator_makes_the_tape_younger():
    def case(FA, GT):
        x, v = const(2), const(2, seed=1)
        with GT(persistent=True) as tape:
            tape.watch(x)
            with FA(x, v) as acc:
                with tape.stop_recording():
                    pass
                y = tf.sin(x)
            jy = acc.jvp(y)
        return jy, tape.gradient(jy, x), tape.gradient(y, x)
    fwd_parity(case)


# -- lifetime of tangents ------------------------------------------------------------

def test_tangent_is_dropped_when_its_tensor_dies():
    import gc
    import weakref

    def case(FA, GT):
        x = const(3)
        with FA(x, tf.ones(3)) as acc:
            refs = []
            for _ in range(5):
                y = tf.sin(x) * x
                refs.append(weakref.ref(acc.jvp(y)))
            kept = tf.exp(x)
            del y
            gc.collect()
            alive = [r() is not None for r in refs]
        return alive, acc.jvp(kept), acc.jvp(x)
    fwd_parity(case)


# -- higher orders through the fallback (transposed gradients) -------------------

_SECOND_ORDER_FNS = {
    "Softplus": tf.nn.softplus,
    "Atan": tf.math.atan,
    "Elu": tf.nn.elu,
    "Cumprod": lambda x: tf.math.cumprod(x),
    "Prod": lambda x: tf.reduce_prod(x) * x,
    "MatrixInverse": lambda x: tf.linalg.inv(tf.reshape(x, [2, 2]) + 2. * tf.eye(2)),
    "Softmax_direct": lambda x: tf.nn.softmax(x) * tf.tanh(x),
    "Erf_Maximum": lambda x: tf.math.erf(tf.maximum(x, 0.1 * x)),
}


@pytest.mark.parametrize("name", sorted(_SECOND_ORDER_FNS))
def test_forward_over_forward_second_order(name):
    fn = _SECOND_ORDER_FNS[name]

    def case(FA, GT):
        x = tf.constant([0.3, -0.6, 1.1, 0.8])
        with FA(x, tf.constant([1., 0.5, -1., 2.])) as outer:
            with FA(x, tf.constant([0., 1., 1., -0.5])) as inner:
                y = fn(x)
            jy = inner.jvp(y)
        return jy, outer.jvp(jy), outer.jvp(y)
    fwd_parity(case, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(_SECOND_ORDER_FNS))
def test_forward_over_reverse_through_fallback_ops(name):
    fn = _SECOND_ORDER_FNS[name]

    def case(FA, GT):
        x = tf.constant([0.3, -0.6, 1.1, 0.8])
        with FA(x, tf.constant([1., 0.5, -1., 2.])) as acc:
            with GT() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(x) ** 2)
            g = tape.gradient(loss, x)
        return g, acc.jvp(g)
    fwd_parity(case, rtol=1e-4, atol=1e-6)


def test_gradient_taken_after_the_accumulator_exits_has_no_jvp():
    def case(FA, GT):
        x = const(3)
        with FA(x, tf.ones(3)) as acc:
            with GT(persistent=True) as tape:
                tape.watch(x)
                y = tf.reduce_sum(tf.sin(x) * x)
            inside = tape.gradient(y, x)
        outside = tape.gradient(y, x)
        return acc.jvp(inside), acc.jvp(outside), acc.jvp(y)
    fwd_parity(case)


def test_forward_over_jacobian():
    def case(FA, GT):
        x = const(3)
        with FA(x, const(3, seed=1)) as acc:
            with GT(persistent=True) as tape:
                tape.watch(x)
                y = tf.sin(x) * tf.reduce_sum(x ** 2)
            jac = tape.jacobian(y, x)
            jac_loop = tape.jacobian(y, x, experimental_use_pfor=False)
        return jac, acc.jvp(jac), acc.jvp(jac_loop)
    fwd_parity(case, rtol=1e-4, atol=1e-6)


def test_forward_over_batch_jacobian():
    def case(FA, GT):
        x = const(2, 3)
        with FA(x, const(2, 3, seed=1)) as acc:
            with GT() as tape:
                tape.watch(x)
                y = tf.tanh(x) * tf.reduce_sum(x, axis=1, keepdims=True)
            jac = tape.batch_jacobian(y, x)
        return jac, acc.jvp(jac)
    fwd_parity(case, rtol=1e-4, atol=1e-6)


def test_jvp_zero_for_unwatched_variable_and_int_tensor():
    def case(FA, GT):
        x = const(2)
        w = tf.Variable([[1., 2.]])
        with FA(x, tf.ones(2)) as acc:
            y = x * w
        return acc.jvp([w, tf.constant([1, 2])], unconnected_gradients="zero"), acc.jvp(y)
    fwd_parity(case)


def test_empty_and_scalar_tensors():
    def case(FA, GT):
        e, s = tf.zeros([0, 3]), tf.constant(1.5)
        with FA((e, s), (tf.zeros([0, 3]), tf.constant(2.))) as acc:
            a = tf.reduce_sum(e, axis=0) + s
            b = tf.nn.softplus(e) * s
            c = tf.concat([e, tf.ones([1, 3]) * s], 0)
            d = tf.math.cumsum(e, axis=1)
        return acc.jvp([a, b, c, d])
    fwd_parity(case)


def test_ops_with_non_differentiable_extra_outputs():
    def case(FA, GT):
        x = tf.constant([3., 1., 3., 2.])
        img = tf.reshape(tf.constant([0.1, 0.9, 0.4, 0.3, 0.7, 0.2, 0.8, 0.5]), [1, 2, 2, 2])
        with FA((x, img), (tf.constant([1., 2., 3., 4.]), tf.ones([1, 2, 2, 2]))) as acc:
            ident = tf.identity_n([x, tf.constant([1, 2])])
            top = tf.math.top_k(x, 2)
            pooled = tf.nn.max_pool2d(img, 2, 2, "VALID")
        return acc.jvp([ident, top.values, top.indices, pooled])
    fwd_parity(case)


def test_op_with_float_output_and_no_gradient_raises_lookuperror():
    # Unique registers no gradient: TF's forward mode raises (its y is float).
    def case(FA, GT):
        x = tf.constant([3., 1., 3., 2.])
        with FA(x, tf.ones(4)) as acc:
            unique = tf.unique(x)
        return acc.jvp(unique.y)
    fwd_error(case, LookupError)


# -- more tf.function and control flow -----------------------------------------------

def test_tf_function_first_traced_inside_nested_accumulators():
    def case(FA, GT):
        @tf.function
        def f(x):
            return tf.nn.elu(x) * tf.math.atan(x) + tf.reduce_prod(x)

        x = tf.constant([0.4, -0.3, 1.2])
        with FA(x, tf.constant([1., 2., 3.])) as outer:
            with FA(x, tf.constant([0., 1., -1.])) as inner:
                y = f(x)
            jy = inner.jvp(y)
        return y, jy, outer.jvp(jy), outer.jvp(y)
    fwd_parity(case, rtol=1e-4, atol=1e-6)


def test_tf_function_with_control_flow_called_inside_accumulator():
    def case(FA, GT):
        @tf.function
        def f(x, n):
            def body(i, acc):
                return i + 1, tf.cond(acc[0] > 0., lambda: acc * x, lambda: acc + tf.sin(x))
            _, out = tf.while_loop(lambda i, acc: i < n, body, (0, x))
            return out

        x = tf.constant([0.5, -0.2])
        with FA(x, tf.constant([1., -2.])) as acc:
            y = f(x, tf.constant(3))
        return y, acc.jvp(y)
    fwd_parity(case, rtol=1e-4, atol=1e-6)


def test_eager_control_flow_inside_accumulator():
    def case(FA, GT):
        x = tf.constant([0.5, -0.2])
        with FA(x, tf.constant([1., -2.])) as acc:
            y = tf.cond(tf.reduce_sum(x) > 0, lambda: x * x, lambda: tf.sin(x))
            _, z = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * x), (0, y))
        return acc.jvp([y, z])
    fwd_parity(case)


def test_vectorized_map_inside_accumulator():
    def case(FA, GT):
        x = const(3, 2)
        with FA(x, const(3, 2, seed=1)) as acc:
            y = tf.vectorized_map(lambda r: tf.nn.softplus(r) * tf.reduce_sum(r), x)
        return y, acc.jvp(y)
    fwd_parity(case, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("pretraced", [False, True], ids=["traced_inside", "pretraced"])
@pytest.mark.parametrize("name", [
    "reduce_prod",
    "reduce_prod_times_x",
    "elu_atan",
])
def test_tf_function_of_one_op_called_inside_accumulator(name, pretraced):
    fn = {"reduce_prod": tf.reduce_prod,
          "reduce_prod_times_x": lambda x: tf.reduce_prod(x) * x,
          "elu_atan": lambda x: tf.nn.elu(x) * tf.math.atan(x)}[name]
    x = tf.constant([0.4, -0.3, 1.2])

    def case(FA, GT):
        f = tf.function(fn)
        if pretraced:
            f(x)
        with FA(x, tf.constant([0., 1., -1.])) as acc:
            y = f(x)
        return y, acc.jvp(y)
    fwd_parity(case)


def test_resource_gather_of_a_variable_primal():
    # TF's own forward mode fails here (AttributeError: the transposed
    # gradient of ResourceGather is IndexedSlices). fasttape densifies it
    # under the transposition's tape (issue 9, fault 10) and gives the
    # gathered rows of the tangent: TF is wrong here.
    import fd

    def case(FA, GT):
        v = tf.Variable([[1., 2.], [3., 4.], [5., 6.]])
        with FA(v, tf.constant([[1., 0.], [0., 1.], [2., 2.]])) as acc:
            a = v.sparse_read([2, 0])
        return acc.jvp(a)
    fd.tf_wrong_here(case, [np.array([[2., 2.], [1., 0.]])],
                     tf_raises=AttributeError)
