"""TF's own leak checkers over every mode of the tape, with TF's classes and
with fasttape's.

TF's eager tests are decorated with ``test_util.assert_no_new_tensors``
(clears the caches it knows about through ``context._clear_caches()``,
collects, and fails on any Tensor, Variable or TensorShape still alive that
was not alive before) and ``test_util.assert_no_garbage_created`` (fails on
uncollectable garbage). fasttape is swapped into such tests, so every cache
it keeps must pass both. The scenarios below are a documented subset that
covers every mode of the tape: plain, persistent, nested (second order),
output_gradients, unconnected zeros, Variables and IndexedSlices,
custom_gradient, tf.function inside a tape and a tape inside tf.function,
eager and pfor jacobians, forward mode and forward-over-reverse, a Keras
model step, and repeated steps that build and replay a compiled backward
pass (``verify`` mode compiles at first use).
"""

import gc
import unittest

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import test_util

import fasttape
from fasttape.gradients import _compiled
from harness import compiled_mode

CLASSES = {
    "tf": (tf.GradientTape, tf.autodiff.ForwardAccumulator),
    "fasttape": (fasttape.GradientTape, fasttape.ForwardAccumulator),
}


def _x(*shape, seed=0):
    return tf.constant(np.random.default_rng(seed).normal(size=shape),
                       dtype=tf.float32)


def plain(GT, FA):
    x = _x(3, 4)
    with GT() as t:
        t.watch(x)
        y = tf.reduce_sum(tf.sin(x) * x)
    return t.gradient(y, x)


def persistent_nested(GT, FA):
    x = _x(3)
    with GT(persistent=True) as outer:
        outer.watch(x)
        with GT(persistent=True) as inner:
            inner.watch(x)
            y = tf.reduce_sum(x ** 3)
        g = inner.gradient(y, x)
        g2 = inner.gradient(y, x)
    return outer.gradient(g, x), outer.gradient(g2, x)


def output_gradients(GT, FA):
    x = _x(2, 3)
    with GT() as t:
        t.watch(x)
        y = tf.tanh(x) * 2.0
    return t.gradient(y, x, output_gradients=tf.ones_like(y) * 0.5)


def unconnected_zero(GT, FA):
    x, z = _x(3), _x(3, seed=1)
    with GT() as t:
        t.watch([x, z])
        y = tf.reduce_sum(x * x)
    return t.gradient(y, [x, z],
                      unconnected_gradients=tf.UnconnectedGradients.ZERO)


def variables_gather(GT, FA):
    v = tf.Variable(_x(5, 2))
    w = tf.Variable(_x(2, 2, seed=1))
    with GT() as t:
        y = tf.reduce_sum(tf.matmul(tf.gather(v, [0, 3, 3]), w))
    return t.gradient(y, [v, w])


def custom_gradient(GT, FA):
    @tf.custom_gradient
    def clipped(x):
        def grad(dy):
            return tf.clip_by_value(dy, -0.1, 0.1)
        return tf.identity(x), grad

    x = _x(4)
    with GT() as t:
        t.watch(x)
        y = tf.reduce_sum(clipped(x) * 3.0)
    return t.gradient(y, x)


def function_inside_tape(GT, FA):
    @tf.function
    def f(x):
        return tf.reduce_sum(tf.exp(x) * x)

    x = _x(3)
    with GT() as t:
        t.watch(x)
        y = f(x)
    return t.gradient(y, x)


def tape_inside_function(GT, FA):
    @tf.function
    def step(x):
        with GT() as t:
            t.watch(x)
            y = tf.reduce_sum(tf.sin(x) ** 2)
        return t.gradient(y, x)

    return step(_x(3))


def jacobian_eager(GT, FA):
    x = _x(3)
    with GT(persistent=True) as t:
        t.watch(x)
        y = tf.sin(x) * x
    return t.jacobian(y, x), t.batch_jacobian(tf.reshape(y, [3, 1]),
                                              tf.reshape(x, [3, 1]))


def jacobian_in_tape_scope(GT, FA):
    x = _x(2, 3)
    with GT() as outer:
        outer.watch(x)
        with GT() as t:
            t.watch(x)
            y = tf.tanh(x)
        j = t.batch_jacobian(y, x)
        s = tf.reduce_sum(j)
    return outer.gradient(s, x)


def jacobian_pfor_function(GT, FA):
    @tf.function
    def f(x):
        with GT() as t:
            t.watch(x)
            y = x ** 2
        return t.jacobian(y, x)

    return f(_x(3))


def forward_mode(GT, FA):
    x = _x(3)
    with FA(x, tf.ones_like(x)) as acc:
        y = tf.sin(x) * tf.exp(x)
    return acc.jvp(y)


def custom_gradient_forward_mode(GT, FA):
    """The accumulator calls the custom backward; one that raises leaves
    nothing behind either."""
    def scaled(fail):
        @tf.custom_gradient
        def f(x):
            def grad(dy):
                if fail:
                    raise ValueError("raised by the custom backward")
                return dy * 3.0
            return x * 2.0, grad
        return f

    x = _x(3)
    with FA(x, tf.ones_like(x)) as acc:
        y = scaled(False)(x)
        try:
            scaled(True)(x)
        except ValueError:
            pass
    return acc.jvp(y)


def forward_over_reverse(GT, FA):
    x, v = _x(3), _x(3, seed=1)
    with FA(x, v) as acc:
        with GT() as t:
            t.watch(x)
            y = tf.reduce_sum(tf.sin(x) * x)
        g = t.gradient(y, x)
    return acc.jvp(g)


def keras_step(GT, FA):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((4,)),
                                 tf.keras.layers.Dense(3, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    x = _x(5, 4)
    with GT() as t:
        loss = tf.reduce_mean(model(x) ** 2)
    return t.gradient(loss, model.trainable_variables)


def repeated_steps(GT, FA):
    """Steps of one tape shape: fasttape builds and replays a compiled pass."""
    w = tf.Variable(_x(4, 4))
    results = []
    for step in range(3):
        x = _x(2, 4, seed=step)
        with GT() as t:
            y = tf.reduce_sum(tf.nn.relu(tf.matmul(x, w)) ** 2)
        results.append(t.gradient(y, w))
    return results


def changing_shapes_reseeded(GT, FA):
    """Steps whose length changes and comes back, with re-seeds between
    some (TFE_ContextClearCaches): the compiled cache counts keys, builds,
    drops kernels and re-instantiates."""
    w = tf.Variable(_x(3, 3))
    results = []
    # A steady length (built in "auto" mode too, at its fourth step: see
    # test_changing_shapes_build_in_auto_mode), a change and back, and a
    # re-seed after the build (its kernels dropped).
    for step, n in enumerate([2, 2, 2, 2, 2, 3, 2, 2, 2, 2]):
        if step in (0, 6):
            tf.random.set_seed(step)
        with GT() as t:
            h = _x(n, 3, seed=step)
            for _ in range(n):
                h = tf.tanh(tf.matmul(h, w))
            y = tf.reduce_sum(h)
        results.append(t.gradient(y, w))
    return results


SCENARIOS = [plain, persistent_nested, output_gradients, unconnected_zero,
             variables_gather, custom_gradient, function_inside_tape,
             tape_inside_function, jacobian_eager, jacobian_in_tape_scope,
             jacobian_pfor_function, forward_mode,
             custom_gradient_forward_mode, forward_over_reverse,
             keras_step, repeated_steps, changing_shapes_reseeded]


class _Checks(unittest.TestCase):
    """The ``self`` TF's decorators expect (they call self.assertEqual)."""

    def runTest(self):  # pragma: no cover - never run as a test
        pass


_compiled_mode = compiled_mode   # compat/harness.py


def _decorated(scenario, impl):
    GT, FA = CLASSES[impl]

    def body(self):
        del self
        result = scenario(GT, FA)
        del result

    return body


def _warm_up(scenario):
    # TF builds process-wide state on first use (lazily loaded gradient
    # modules, Keras globals, forwardprop's cache of traced JVP functions,
    # which TF's clear_caches leaves alone): run the scenario once with TF's
    # classes so that this state exists before either side is checked.
    # fasttape runs only a plain gradient first, so that any cache of its
    # own that the scenario fills is seen by the checker.
    scenario(*CLASSES["tf"])
    plain(*CLASSES["fasttape"])
    tf.keras.backend.clear_session()


# fasttape in "verify" mode too: the compiled pass is built at first use.
@pytest.mark.parametrize("impl,mode", [("tf", "auto"), ("fasttape", "auto"),
                                       ("fasttape", "verify")])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_no_new_tensors(scenario, impl, mode):
    _warm_up(scenario)
    with _compiled_mode(mode):
        test_util.assert_no_new_tensors(_decorated(scenario, impl))(_Checks())


@pytest.mark.parametrize("impl", ["tf", "fasttape"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_no_garbage_created(scenario, impl):
    _warm_up(scenario)
    with _compiled_mode("verify"):
        test_util.assert_no_garbage_created(_decorated(scenario, impl))(_Checks())


# TF's object-counting leak check (test_util.assert_no_new_pyobjects_executing_eagerly,
# used by TF's own forwardprop_test.py::testHVPCorrectness) runs its body twice
# to warm caches, then three times comparing Python objects and
# context.list_function_names(): a gradient key used once per run reaches
# fasttape's build (auto mode) inside the counted runs.
class _HVPLikeTest(tf.test.TestCase):
    __test__ = False     # run by the test below, once per implementation
    impl = "tf"

    @test_util.assert_no_new_pyobjects_executing_eagerly()
    def test_hvp(self):
        GT, FA = CLASSES[self.impl]

        def fun(x):
            return tf.reduce_prod(tf.tanh(x) ** 2)

        def hvp(primals, tangents):
            with FA(primals, tangents) as acc:
                with GT() as tape:
                    tape.watch(primals)
                    out = fun(primals)
                return acc.jvp(tape.gradient(out, primals))

        primals = tf.constant([1., 2., 3.])
        tangents = tf.constant([3., 4., 5.])
        eager = hvp(primals, tangents)
        with GT(persistent=True) as g:
            g.watch(primals)
            with GT() as gg:
                gg.watch(primals)
                out = fun(primals)
            grad = tf.unstack(gg.gradient(out, primals))
        hessian = tf.stack([g.gradient(grad[i], primals) for i in range(3)])
        self.assertAllClose(tf.tensordot(hessian, tangents, axes=1), eager)


@pytest.mark.parametrize("impl", ["tf", "fasttape"])
def test_object_counting_check_sees_no_compiled_pass(impl):
    fasttape.clear_caches()
    case = type("Case", (_HVPLikeTest,), {"impl": impl})("test_hvp")
    result = unittest.TestResult()
    with _compiled_mode("auto"):
        case.run(result)
    assert result.wasSuccessful(), result.failures + result.errors


def test_clear_caches_releases_compiled_functions():
    """What fasttape.clear_caches() (and context._clear_caches()) does to a
    built pass: its traced function leaves TF's context."""
    before = context.context().list_function_names()
    with _compiled_mode("always"):
        repeated_steps(*CLASSES["fasttape"])
    built = {name for name in context.context().list_function_names() - before
             if name.startswith("__inference_backward")}
    assert built
    context.context()._clear_caches()  # pylint: disable=protected-access
    gc.collect()
    assert not context.context().list_function_names() & built


def test_the_harness_leak_check_sees_reference_cycles():
    """harness.assert_leaks_nothing fails on a step that leaves an ordinary
    reference cycle (TF's garbage decorator alone does not see one), and
    passes a step that leaves none."""
    from harness import assert_leaks_nothing

    def cyclic():
        a = [tf.constant(1.0)]
        a.append(a)

    with pytest.raises(AssertionError, match="reference cycles"):
        assert_leaks_nothing(cyclic)
    assert_leaks_nothing(lambda: [tf.constant(1.0)])


_AUTO_BUILD_CHILD = """
import json, sys
sys.path[:0] = sys.argv[1:3]
import test_leaks as T
from fasttape.gradients import _compiled
T._warm_up(T.changing_shapes_reseeded)
with T._compiled_mode("auto"):
    _compiled.CACHE.clear()
    T.changing_shapes_reseeded(*T.CLASSES["fasttape"])
print(json.dumps(dict(_compiled.CACHE.stats)))
"""


def test_changing_shapes_build_in_auto_mode():
    """changing_shapes_reseeded exercises the compiled cache in "auto" mode
    (the mode test_no_new_tensors runs it in): passes are built and
    replayed, not only run eagerly. In a fresh process: auto mode weighs
    what this process has measured and seen (earlier builds, kernel-cache
    clears), so the suite's history must not decide it."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               FASTTAPE_COMPILED_BACKWARD="auto")
    out = subprocess.run(
        [sys.executable, "-c", _AUTO_BUILD_CHILD, os.path.dirname(here), here],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats.get("skipped", 0) == 0, stats
    assert stats.get("built", 0) >= 1 and stats.get("replayed", 0) >= 1, stats
