"""Where TF is wrong and fasttape right (issue 14, items 1, 2 and 4, and one
found on the way): each case is judged by float64 central differences
(``fd.tf_wrong_here``): fasttape must match them, and TF's wrong behaviour is
asserted too, so that a test fails the day TF is fixed and the README's
"Where fasttape differs from TF" needs updating.
"""

import numpy as np
import pytest
import tensorflow as tf

import fd

# -- item 1: reverse-over-forward through a tf.function --------------------------
#
# A tape around an accumulator around a tf.function call, gradient of the JVP:
# TF's function call records a backward function whose own gradient drops the
# second-order terms (zeros), or fails to build (a Variable argument). Eager
# TF (the same body without tf.function) and fasttape agree with finite
# differences.

_T1 = np.array([-0.028, 2.113])


def _reverse_over_forward_oracle(np_f, x0, t0):
    """d/dx of the directional derivative of sum(2 f(x)) along t0."""
    def jvp(x):
        return fd.jvp_oracle(lambda v: np.sum(2. * np_f(v)), [x], [t0], eps=1e-5)
    return fd.vjp_oracle(jvp, [x0], eps=1e-4)


def _reverse_over_forward_case(f, x0, t0, dtype):
    def case(FA, GT):
        x = tf.constant(x0, dtype)
        fn = tf.function(f)
        with GT() as tape:
            tape.watch(x)
            with FA([x], [tf.constant(t0, dtype)]) as acc:
                y = tf.reduce_sum(tf.cast(fn(x) * 2., tf.float64))
            jv = acc.jvp(y)
        return [tape.gradient(jv, x)]
    return case


def _log_softmax(v):
    return v - np.log(np.sum(np.exp(v)))


_RO_F = {
    # The issue's example (float32 through a cast to float64); TF: zeros.
    "log_softmax": (lambda x: tf.nn.log_softmax(x, axis=0), _log_softmax,
                    [0.906, 1.22], _T1, tf.float32),
    "stack": (lambda x: tf.stack([x * x, tf.sin(x)], axis=1),
              lambda x: np.stack([x * x, np.sin(x)], axis=1),
              [0.906, 1.22], _T1, tf.float64),
    "maximum": (lambda x: tf.maximum(x * x, 1.1), lambda x: np.maximum(x * x, 1.1),
                [0.906, 1.22], _T1, tf.float64),
    "slogdet": (lambda x: tf.linalg.slogdet(x)[1],
                lambda x: np.linalg.slogdet(x)[1],
                [[1.3, 0.2], [0.4, 0.9]], [[0.3, -0.5], [0.7, 0.1]], tf.float64),
    "gather": (lambda x: tf.gather(x, [1, 0, 1]) ** 3,
               lambda x: x[[1, 0, 1]] ** 3, [0.906, 1.22], _T1, tf.float64),
}


@pytest.mark.parametrize("name", sorted(_RO_F))
def test_reverse_over_forward_through_tf_function(name):
    f, np_f, x0, t0, dtype = _RO_F[name]
    x0, t0 = np.asarray(x0, np.float64), np.asarray(t0, np.float64)
    oracle = _reverse_over_forward_oracle(np_f, x0, t0)
    tf_result, _ = fd.tf_wrong_here(
        _reverse_over_forward_case(f, x0, t0, dtype), oracle)
    # What TF gives instead: zeros (the gather: None).
    leaf = tf_result[0]
    assert leaf is None or not np.any(tf.convert_to_tensor(leaf).numpy()), tf_result


def test_reverse_over_forward_through_tf_function_body_eagerly_agrees():
    """The same log_softmax case with the body run eagerly: TF is right there
    (so the fault is TF's function gradient, not the case)."""
    f, np_f, x0, t0, dtype = _RO_F["log_softmax"]
    oracle = _reverse_over_forward_oracle(np_f, np.asarray(x0), t0)

    def case(FA, GT):
        x = tf.constant(x0, dtype)
        with GT() as tape:
            tape.watch(x)
            with FA([x], [tf.constant(t0, dtype)]) as acc:
                y = tf.reduce_sum(tf.cast(f(x) * 2., tf.float64))
            jv = acc.jvp(y)
        return [tape.gradient(jv, x)]
    for impl in ("tf", "fasttape"):
        assert fd.matches(fd.run(case, impl), oracle, 1e-4, 1e-5), impl


def test_reverse_over_forward_through_tf_function_with_a_variable_argument():
    """TF raises ValueError ("variable without handle data")."""
    v0, t0 = np.array([0.906, 1.22]), _T1

    def np_f(v):
        return _log_softmax(v * v)
    oracle = _reverse_over_forward_oracle(np_f, v0, t0)

    def case(FA, GT):
        v = tf.Variable(v0)

        @tf.function
        def f(v):
            return tf.nn.log_softmax(v * v, axis=0)
        with GT() as tape:
            with FA([v], [tf.constant(t0)]) as acc:
                y = tf.reduce_sum(f(v) * 2.)
            jv = acc.jvp(y)
        return [tape.gradient(jv, v)]
    fd.tf_wrong_here(case, oracle, tf_raises=ValueError)


# -- item 2: ForwardAccumulator, a Variable passed into a tf.function -----------

def test_accumulator_with_a_variable_passed_into_a_tf_function():
    """TF raises ValueError ("variable without handle data")."""
    def case(FA, GT):
        w = tf.Variable(1.119, dtype=tf.float64)

        @tf.function
        def f(w):
            return tf.reshape(w, [1, 1]) * w
        with FA(w, tf.constant(-0.878, tf.float64)) as acc:
            y = f(w)
        return [acc.jvp(y)]
    oracle = [fd.jvp_oracle(lambda w: np.reshape(w * w, [1, 1]),
                            [np.array(1.119)], [np.array(-0.878)])]
    fd.tf_wrong_here(case, oracle, tf_raises=ValueError)


def test_accumulator_inside_a_tf_function_over_an_embedding_lookup():
    """An accumulator entered inside a tf.function over
    tf.nn.embedding_lookup of a Variable: TF raises ValueError ("Duplicate
    node name in graph: 'embedding_lookup'"); fasttape returns the JVP.
    Found by a drawn program (tests of forward mode over random op chains)."""
    table0 = np.array([[0.3, -1.2], [0.8, 0.1], [-0.5, 0.7]])
    t0 = np.array([[0.2, 0.9], [-0.4, 0.3], [1.1, -0.6]])
    x0 = np.array([[0.5, -0.2], [0.1, 0.4]])
    ids = [2, 0]

    def case(FA, GT):
        table = tf.Variable(table0)

        @tf.function
        def f(x):
            with FA([table], [tf.constant(t0)]) as acc:
                y = tf.reduce_sum(tf.sin(x + tf.nn.embedding_lookup(table, ids)))
            return acc.jvp(y)
        return [f(tf.constant(x0))]
    oracle = [fd.jvp_oracle(lambda t: np.sum(np.sin(x0 + t[ids])),
                            [table0], [t0])]
    fd.tf_wrong_here(case, oracle, tf_raises=ValueError)

def test_accumulator_inside_a_tf_function_over_a_scan():
    """An accumulator entered inside a tf.function over tf.scan (a While
    loop over TensorLists): TF raises TypeError ("`dtype` <dtype: 'variant'>
    is not compatible with 1 of dtype int64"), with fasttape imported or
    not; fasttape returns the JVP. Found by a drawn program."""
    x0 = np.array([[0.5, -0.2, 0.3], [0.1, 0.4, -0.7], [0.9, -0.3, 0.2]])
    t0 = np.array([[0.2, 0.9, -0.1], [-0.4, 0.3, 0.5], [1.1, -0.6, 0.8]])

    def case(FA, GT):
        @tf.function
        def f(x):
            with FA([x], [tf.constant(t0)]) as acc:
                y = tf.reduce_sum(tf.sin(tf.scan(lambda a, r: a * 0.5 + r, x)))
            return acc.jvp(y)
        return [f(tf.constant(x0))]

    def scan(x):
        a, out = x[0], [x[0]]
        for r in x[1:]:
            a = a * 0.5 + r
            out.append(a)
        return np.sum(np.sin(out))
    oracle = [fd.jvp_oracle(scan, [x0], [t0])]
    # (tf.scan sets the variable scope's caching device while it builds its
    # loop and, raising, never unsets it: the process's scope, which a
    # FuncGraph shares, would keep it, and tf.recompute_grad raises after)
    scope = tf.compat.v1.get_variable_scope()
    before = scope.caching_device
    try:
        fd.tf_wrong_here(case, oracle, tf_raises=TypeError)
    finally:
        scope._caching_device = before  # pylint: disable=protected-access (set_caching_device refuses in eager)


def test_accumulator_inside_a_tf_function_over_a_switch_case():
    """An accumulator entered inside a tf.function over tf.switch_case (a
    Case op): TF raises TypeError ("Could not generate a generic TraceType
    for name: switch_case_indexed_case_branch0_N", its JVP tracing meets the
    branch functions' names); fasttape returns the JVP. Found by the
    fuzzer."""
    x0, t0 = np.array([0.3, -1.2]), np.array([1.0, 0.5])

    def case(FA, GT):
        @tf.function(autograph=False)
        def f(x):
            with FA(x, tf.constant(t0)) as acc:
                y = tf.switch_case(tf.constant(1), [lambda: x * 2.0,
                                                    lambda: tf.sin(x) * x])
            return [acc.jvp(y)]
        return f(tf.constant(x0))
    oracle = [fd.jvp_oracle(lambda x: np.sin(x) * x, [x0], [t0])]
    fd.tf_wrong_here(case, oracle, tf_raises=TypeError)


def test_accumulator_with_a_variable_passed_into_a_tf_function_issue_form():
    def case(FA, GT):
        w = tf.Variable(1.119, dtype=tf.float64)

        @tf.function
        def f(w):
            return tf.reshape(w, [1, 1])
        with FA(w, tf.constant(-0.878, tf.float64)) as acc:
            y = f(w)
        return [acc.jvp(y)]
    fd.tf_wrong_here(case, [np.array([[-0.878]])], tf_raises=ValueError)


# -- found by the fuzzer: forward-over-reverse, IndexedSlices into a tf.function -

def _gather_hvp_case(where):
    def case(FA, GT):
        x = tf.constant([[0.3], [-1.2]], tf.float64)

        def take(v):
            return tf.gather(v, [0], axis=0)

        def scale(v):
            return v * 1.0
        with FA(x, tf.constant([[1.0], [0.5]], tf.float64)) as acc:
            with GT() as tape:
                tape.watch(x)
                if where == "gather in the function":
                    y = tf.sin(tf.function(take)(x))
                elif where == "gather after the function":
                    y = tf.sin(take(tf.function(scale)(x)))
                else:
                    y = tf.sin(take(scale(x)))
            g = tf.convert_to_tensor(tape.gradient(y, x))
        return [acc.jvp(g)]
    return case


@pytest.mark.parametrize("where", ["gather in the function",
                                   "gather after the function"])
def test_forward_over_reverse_of_a_gather_and_a_tf_function(where):
    """The accumulator's JVP of the (densified) gradient of sin(gather(x)),
    where the gather's IndexedSlices gradient meets a tf.function's backward
    (the gather inside it, or after it): TF raises AttributeError
    ("'IndexedSlices' object has no attribute '_id'"); fasttape gives what
    TF gives without the tf.function."""
    x0 = np.array([[0.3], [-1.2]])
    hvp = fd.jvp_oracle(lambda v: np.concatenate([np.cos(v[:1]), 0 * v[1:]]),
                        [x0], [np.array([[1.0], [0.5]])])
    fd.tf_wrong_here(_gather_hvp_case(where), [hvp], tf_raises=AttributeError)
    eager = fd.run(_gather_hvp_case("no function"), "tf")
    assert fd.matches(eager, [hvp], 1e-6, 1e-8), eager


# -- found by the fuzzer: the jacobian of an untracked tensor by itself ---------

@pytest.mark.parametrize("use_pfor", [True, False], ids=["pfor", "loop"])
def test_jacobian_of_an_untracked_tensor_by_itself(use_pfor):
    """Nothing watched, y = sin(c): TF's gradient(y, [y]) gives ones (the
    seed), but TF's jacobian(y, [y]) gives None (it slices y under the tape,
    and an untracked y's slice is not recorded); fasttape gives the
    identity, the finite differences' answer."""
    def case(FA, GT):
        c = tf.constant([0.7, 0.2], tf.float64)
        with GT(persistent=True) as tape:
            y = tf.sin(c)
        return tape.jacobian(y, [y], experimental_use_pfor=use_pfor)
    fd.tf_wrong_here(case, [np.eye(2)])

    def gradient_case(FA, GT):
        c = tf.constant([0.7, 0.2], tf.float64)
        with GT() as tape:
            y = tf.sin(c)
        return tape.gradient(y, [y])
    assert fd.matches(fd.run(gradient_case, "tf"), [np.ones(2)], 0, 0)


# -- item 4: forward-over-reverse through softmax_cross_entropy_with_logits -------
#
# Labels that depend on x: TF's JVP of the loss's gradient misses the
# second-order term through the labels (its reverse-over-reverse agrees with
# its own JVP, so both are wrong the same way).

def _xent_np(x):
    v = x[np.newaxis]
    log_p = v - np.log(np.sum(np.exp(v), axis=-1, keepdims=True))
    labels = np.exp(log_p)
    return np.sum(-labels * log_p)


def test_forward_over_reverse_softmax_cross_entropy_labels_depend_on_x():
    x0 = np.array([[0.5, -0.3, 1.1]])
    t0 = np.array([[1.32, -0.599, 0.592]])

    def case(FA, GT):
        x = tf.constant(x0)
        with FA(x, tf.constant(t0)) as acc:
            with GT() as tape:
                tape.watch(x)
                v = x[tf.newaxis]
                loss = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(
                    labels=tf.nn.softmax(v), logits=v))
            g = tape.gradient(loss, x)
        return [acc.jvp(g)]

    def grad_np(x):
        return fd.vjp_oracle(_xent_np, [x], eps=1e-5)[0]
    oracle = [fd.jvp_oracle(grad_np, [x0], [t0], eps=1e-4)]
    fd.tf_wrong_here(case, oracle)


# -- found on the way: a custom_gradient whose grad_fn runs its own tape ---------

def test_custom_gradient_with_a_tape_inside_its_grad_fn():
    """An accumulator through a custom_gradient whose forward it cannot see
    (stop_gradient) transposes the grad_fn; a grad_fn that computes its
    gradient with a GradientTape of its own (as TF's _FusedBatchNormGradGrad
    does) gives TF's accumulator None."""
    x0, t0 = np.array([1.0, 2.0, -0.5]), np.array([0.3, -1.1, 0.8])

    def case(FA, GT):
        x = tf.constant(x0)

        @tf.custom_gradient
        def cube(v):
            def grad(dy):
                with GT() as inner:
                    inner.watch(v)
                    w = v * v * v
                return inner.gradient(w, v, output_gradients=dy)
            return tf.stop_gradient(v * v * v), grad

        with FA(x, tf.constant(t0)) as acc:
            y = cube(x)
        return [acc.jvp(y)]
    oracle = [fd.jvp_oracle(lambda v: v ** 3, [x0], [t0])]
    tf_result, _ = fd.tf_wrong_here(case, oracle)
    assert tf_result == [None]


def test_reverse_over_forward_of_a_while_loop_inside_tf_function():
    """Tape and accumulator both inside a tf.function, a while_loop between
    them: TF's gradient of the JVP is None."""
    def np_f(x):
        y = x
        for _ in range(3):
            y = np.sin(y) * x
        return y
    oracle = fd.vjp_oracle(
        lambda x: fd.jvp_oracle(np_f, [x], [np.ones(())], eps=1e-5),
        [np.array(2.0)], eps=1e-4)

    def case(FA, GT):
        @tf.function
        def f(x):
            with GT() as tape:
                tape.watch(x)
                with FA(x, tf.ones_like(x)) as acc:
                    _, y = tf.while_loop(
                        lambda i, y: i < 3,
                        lambda i, y: (i + 1, tf.sin(y) * x), [0, x])
                jv = acc.jvp(y)
            return [tape.gradient(jv, x)]
        return f(tf.constant(2.0, tf.float64))
    tf_result, _ = fd.tf_wrong_here(case, oracle)
    assert tf_result == [None]


# -- pfor and grouped convolutions ----------------------------------------------
#
# A grouped convolution (its kernel has fewer input channels than its input:
# Keras 3's Conv2D(groups=2), which Keras runs in a jit_compile function, or
# tf.nn.conv2d with a [kh, kw, cin / groups, cout] kernel): pfor's converters
# for its gradients fold the Jacobian's rows into the kernel's output
# channels, which a grouped kernel gradient splits by group. TF's pfor
# jacobian of the kernel is silently wrong (float32) or raises
# InvalidArgumentError (float64, the kernel's and the input's); fasttape
# builds these rows by a loop.

@tf.function(jit_compile=True)
def _grouped_conv(x, k):
    return tf.nn.conv2d(x, k, 1, "VALID")


def _grouped_conv_case(dtype, wrt, where, keras_layer, size=5, batch=2):
    """(case, oracle): the jacobian (wrt "kernel") or batch_jacobian (wrt
    "input") of a 4 -> 4 channel, 2-group 3x3 convolution."""
    rng = np.random.default_rng(7)
    x0 = rng.normal(size=(batch, size, size, 4))
    k0 = rng.normal(size=(3, 3, 2, 4))
    if keras_layer:
        import keras  # noqa: PLC0415 - Keras 3 only for these cases
        layer = keras.layers.Conv2D(4, 3, groups=2, use_bias=False,
                                    dtype=dtype)
        layer.build(x0.shape)
        layer.kernel.assign(k0)
        kernel, conv = layer.kernel, lambda x: layer(x)
    else:
        kernel = tf.Variable(k0, dtype=dtype)
        conv = lambda x: _grouped_conv(x, kernel)  # noqa: E731

    def body(GT, x):
        with GT() as tape:
            tape.watch(x)
            y = conv(x)
        if wrt == "kernel":
            return tape.jacobian(y, kernel)
        return tape.batch_jacobian(y, x)

    def case(FA, GT):
        x = tf.constant(x0, dtype)
        if where == "function":
            return tf.function(lambda x: body(GT, x))(x)
        return body(GT, x)

    f = lambda x, k: _grouped_conv(  # noqa: E731
        tf.constant(x), tf.constant(k)).numpy()
    if wrt == "kernel":
        [oracle] = fd.central_difference(lambda k: f(x0, k), [k0])
    else:
        [full] = fd.central_difference(lambda x: f(x, k0), [x0])
        oracle = np.stack([full[b, ..., b, :, :, :] for b in range(batch)])
    return case, oracle


@pytest.mark.parametrize("dtype,wrt,where,keras_layer,size,tf_raises", [
    ("float32", "kernel", "function", False, 5, None),
    ("float32", "kernel", "eager", True, 12, None),   # 1600 rows: pfor
    ("float64", "kernel", "function", True, 5, tf.errors.InvalidArgumentError),
    ("float64", "input", "function", True, 5, tf.errors.InvalidArgumentError),
], ids=["conv2d-kernel-function-f32", "keras-kernel-eager-1600rows-f32",
        "keras-kernel-function-f64", "keras-input-function-f64"])
def test_jacobian_of_a_grouped_convolution(dtype, wrt, where, keras_layer,
                                           size, tf_raises):
    """TF's pfor jacobian/batch_jacobian through a grouped convolution is
    wrong; fasttape's equals the finite differences."""
    case, oracle = _grouped_conv_case(dtype, wrt, where, keras_layer,
                                      size=size, batch=4 if size > 5 else 2)
    fd.tf_wrong_here(case, [oracle], tf_raises=tf_raises, rtol=1e-4,
                     atol=1e-3 if dtype == "float32" else 1e-6)


# -- found by the DP hunt: pfor's Roll along an axis counted from the end ------
#
# TF's pfor converter for Roll adds 1 to the axis for the loop's own, so
# an axis counted from the end names the next one; tape.jacobian (pfor on)
# and tf.vectorized_map are silently wrong there.

@pytest.mark.parametrize("where", ["eager", "function"])
def test_jacobian_of_a_roll_along_an_axis_from_the_end(where):
    """TF's pfor jacobian through tf.roll(..., axis=-3) is wrong; fasttape's
    equals the finite differences (it takes such rows by a loop)."""
    x0 = np.random.default_rng(3).normal(size=(3, 4, 2))

    def body(GT, x):
        with GT() as tape:
            tape.watch(x)
            y = tf.roll(x * x, 1, axis=-3)
        return [tape.jacobian(y, x)]

    def case(FA, GT):
        x = tf.constant(x0)
        if where == "function":
            return tf.function(lambda x: body(GT, x))(x)
        return body(GT, x)

    [oracle] = fd.central_difference(
        lambda x: np.roll(x * x, 1, axis=-3), [x0])
    fd.tf_wrong_here(case, [oracle], rtol=1e-6, atol=1e-6)


# -- pfor and a diagonal Einsum ------------------------------------------------
#
# TF's pfor converter for Einsum puts its loop's label before the equation's
# and builds the op with tf.einsum, which refuses a label repeated in the
# output: the gradient of a diagonal ("ii->i"), "i->ii", becomes "ai->aii".

def test_jacobian_through_a_diagonal_einsum_in_a_function():
    """TF's traced pfor jacobian through tf.einsum("ii->i", ...) raises
    ValueError; fasttape's equals the finite differences (it takes such
    rows by a loop)."""
    x0 = np.random.default_rng(4).normal(size=(3, 3))
    w0 = np.array([0.5, -1.0, 2.0])

    def case(FA, GT):
        def body(x):
            with GT() as tape:
                tape.watch(x)
                y = tf.einsum("ii->i", tf.tanh(x * w0))
            return [tape.jacobian(y, x)]
        return tf.function(body)(tf.constant(x0))

    [oracle] = fd.central_difference(
        lambda x: np.diagonal(np.tanh(x * w0)).copy(), [x0])
    fd.tf_wrong_here(case, [oracle], tf_raises=ValueError, rtol=1e-6, atol=1e-6)


# -- found by a generated hunt: forward-over-reverse through a while_loop -------

@pytest.mark.parametrize("flow", ["while_loop", "cond"])
def test_forward_over_reverse_of_control_flow_in_a_tf_function(flow):
    """An accumulator around a tape around a tf.function holding a
    tf.while_loop or a tf.cond (a Hessian-vector product): TF's accumulator
    transposes the function's backward, whose control-flow gradient keeps
    variant intermediates, and raises TypeError ("`dtype` <dtype: 'variant'>
    is not compatible with 1 of dtype int64"); fasttape gives the HVP.
    Without the tf.function TF gets it right (in a fresh process)."""
    x0, t0 = np.array([0.3, -0.7, 1.1]), np.array([1.0, -0.5, 0.25])
    v0 = np.array([0.5, 1.2, -0.4])

    def np_grad(x):
        def f(x):
            y = x
            for _ in range(2 if flow == "while_loop" else 1):
                y = np.tanh(y) * v0
            return np.sum(y * x)
        return fd.vjp_oracle(f, [x], eps=1e-5)[0]
    oracle = [np_grad(x0), fd.jvp_oracle(np_grad, [x0], [t0], eps=1e-4)]

    def case(FA, GT):
        x = tf.constant(x0)
        v = tf.constant(v0)

        @tf.function
        def f(x):
            if flow == "while_loop":
                _, y = tf.while_loop(lambda i, y: i < 2,
                                     lambda i, y: (i + 1, tf.tanh(y) * v), [0, x])
            else:
                y = tf.cond(tf.reduce_sum(x) < 10.0, lambda: tf.tanh(x) * v,
                            lambda: x)
            return tf.reduce_sum(y * x)
        with FA(x, tf.constant(t0)) as acc:
            with GT() as tape:
                tape.watch(x)
                y = f(x)
            g = tape.gradient(y, x)
        return [g, acc.jvp(g)]
    fd.tf_wrong_here(case, oracle, tf_raises=TypeError)
