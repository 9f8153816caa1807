"""Compiled backward passes (fasttape._compiled) against tf.GradientTape.

Each program runs several steps, with values that change from step to step
(so a value baked into a compiled graph would show), under tf.GradientTape
and under fasttape with the cache in ``always`` mode (compiled at first
use, replayed after) and ``auto`` (compiled at second use). Every step's
gradients are compared with TF's, and the cache's counters prove the
compiled path really ran (or, where it must not, that it did not).
"""

import contextlib
import types

import numpy as np
import pytest
import tensorflow as tf

import fasttape
from fasttape.gradients import _compiled
from fasttape.recording import _recording
from harness import assert_same

STEPS = 4


@pytest.fixture(autouse=True)
def keep_compiled(monkeypatch):
    """Small test programs may run faster op by op; keep their compiled
    passes anyway, so that these tests exercise them."""
    monkeypatch.setattr(_compiled.CACHE, "keep_faster", False)


@contextlib.contextmanager
def _in_mode(mode):
    """The cache in ``mode``, empty before and after."""
    _compiled.CACHE.clear()
    previous = _compiled.set_mode(mode)
    try:
        yield
    finally:
        _compiled.set_mode(previous)
        _compiled.CACHE.clear()


@pytest.fixture(params=["always", "auto"])
def mode(request):
    with _in_mode(request.param):
        yield request.param


def _rng(step):
    return np.random.default_rng(100 + step)


def _f32(rng, *shape):
    return tf.constant(rng.normal(size=shape).astype("float32"))


def _run(program, steps=STEPS):
    """Per step, TF's result and fasttape's, compared; returns the stats."""
    _compiled.CACHE.stats.clear()
    for step in range(steps):
        expected = program(tf.GradientTape, step)
        actual = program(fasttape.GradientTape, step)
        assert_same(expected, actual, path=f"step {step}")
    return dict(_compiled.CACHE.stats)


def _assert_replayed(stats, mode, steps=STEPS, per_step=1):
    # always: built at step 0, replayed after; auto: eager at 0, built at 1.
    expected = (steps - 1 if mode == "always" else steps - 2) * per_step
    assert stats.get("replayed", 0) >= expected, stats
    assert not stats.get("failed"), stats


# -- programs -------------------------------------------------------------------

def chain(Tape, step):
    rng = _rng(step)
    x, y = _f32(rng, 2, 2), _f32(rng, 2, 2)
    with Tape() as t:
        t.watch(x)
        for _ in range(20):
            y = tf.sin(y) * x
    return t.gradient(y, x)


_MLP = {}


def mlp(Tape, step):
    """A training step; the variables differ per implementation (each gets
    the same values at step 0) and are updated with its own gradients."""
    params = _MLP.setdefault(Tape, [
        tf.Variable(np.random.default_rng(i).normal(0, 0.3, s).astype("float32"))
        for i, s in enumerate([(8, 16), (16,), (16, 4), (4,)])])
    rng = _rng(step)
    x = _f32(rng, 5, 8)
    labels = tf.constant(rng.integers(0, 4, 5))
    with Tape() as t:
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, params[0]), params[1]))
        logits = tf.nn.bias_add(tf.matmul(h, params[2]), params[3])
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    grads = t.gradient(loss, params)
    for p, g in zip(params, grads):
        p.assign_sub(0.1 * g)
    return grads


def embedding(Tape, step):
    rng = np.random.default_rng(7)
    table = tf.Variable(rng.normal(size=(20, 3)).astype("float32"))
    ids = tf.constant(_rng(step).integers(0, 20, (6,)))
    with Tape() as t:
        loss = tf.reduce_sum(tf.gather(table, ids) ** 2)
    g = t.gradient(loss, table)
    assert isinstance(g, tf.IndexedSlices)
    return g


def output_gradients(Tape, step):
    rng = _rng(step)
    x, w = _f32(rng, 3), _f32(rng, 3)
    with Tape() as t:
        t.watch(x)
        y = tf.tanh(x * w)
    return t.gradient(y, x, output_gradients=_f32(rng, 3))


def persistent_two_targets(Tape, step):
    rng = _rng(step)
    x = _f32(rng, 4)
    with Tape(persistent=True) as t:
        t.watch(x)
        a = tf.exp(x)
        b = tf.reduce_sum(a * x)
    return t.gradient(a, x), t.gradient(b, x), t.gradient(b, a)


def unconnected_zero(Tape, step):
    rng = _rng(step)
    x, z = _f32(rng, 3), _f32(rng, 2)
    with Tape() as t:
        t.watch([x, z])
        y = tf.reduce_sum(tf.square(x))
    return t.gradient(y, [x, z], unconnected_gradients="zero")


def changing_axis(Tape, step):
    """Same shapes every step, a different reduction axis (a tensor the
    gradient reads): a configuration input, baked into the compiled pass as
    TF's eager gradient reads its value, so each value has its own pass."""
    rng = _rng(0)
    x, w = _f32(rng, 3, 3), _f32(rng, 3)
    with Tape() as t:
        t.watch(x)
        s = tf.reduce_sum(x, axis=tf.constant(step % 2))
        y = tf.reduce_sum(s * w)
    return t.gradient(y, x)


def changing_shapes(Tape, step):
    rng = _rng(step)
    x = _f32(rng, 2 + step % 2, 3)
    with Tape() as t:
        t.watch(x)
        y = tf.reduce_mean(tf.sigmoid(x) * x, axis=0)
    return t.gradient(y, x)


def partly_used_outputs(Tape, step):
    rng = _rng(step)
    x = _f32(rng, 4, 2)
    with Tape() as t:
        t.watch(x)
        a, _, c, _ = tf.unstack(x)
        y = a * c
    return t.gradient(y, x)


def conv_pool(Tape, step):
    rng = _rng(step)
    x, k, b = _f32(rng, 2, 6, 6, 3), _f32(rng, 3, 3, 3, 4), _f32(rng, 4)
    with Tape() as t:
        t.watch([k, b])
        h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, k, 1, "SAME"), b))
        y = tf.reduce_sum(tf.nn.max_pool2d(h, 2, 2, "VALID"))
    return t.gradient(y, [k, b])


def source_is_target(Tape, step):
    rng = _rng(step)
    x = _f32(rng, 3)
    with Tape() as t:
        t.watch(x)
        y = tf.sin(x)
    return t.gradient([y, x], [x, y])


def jacobian(Tape, step):
    rng = _rng(step)
    x, w = _f32(rng, 1, 3), _f32(rng, 3, 4)
    with Tape(persistent=True) as t:
        t.watch(x)
        y = tf.tanh(tf.matmul(x, w))
    return t.jacobian(y, x, experimental_use_pfor=False)


def gather_axis(Tape, step):
    """GatherV2's gradient is IndexedSlices only where its axis is known to
    be 0; with the axis fed as a placeholder it would be dense."""
    rng = _rng(step)
    x = _f32(rng, 5, 2)
    idx = tf.constant(rng.integers(0, 5, 40))   # data: too big to bake, fed
    with Tape() as t:
        t.watch(x)
        y = tf.reduce_sum(tf.gather(x, idx, axis=tf.constant(0)) ** 2)
    g = t.gradient(y, x)
    assert isinstance(g, tf.IndexedSlices)
    return g


COMPILED = [chain, mlp, embedding, output_gradients, unconnected_zero,
            partly_used_outputs, conv_pool, source_is_target, gather_axis]


@pytest.mark.parametrize("program", COMPILED, ids=lambda p: p.__name__)
def test_compiled_matches_tf(mode, program):
    _MLP.clear()
    _assert_replayed(_run(program), mode)


def test_persistent_tape_several_targets(mode):
    _assert_replayed(_run(persistent_two_targets), mode, per_step=3)


@pytest.mark.parametrize("program", [changing_shapes, changing_axis],
                         ids=lambda p: p.__name__)
def test_shapes_and_configs_key_separate_passes(mode, program):
    stats = _run(program, steps=6)
    assert stats.get("replayed", 0) >= (4 if mode == "always" else 2), stats


def test_jacobian_rows_replay(mode):
    stats = _run(jacobian, steps=2)
    # 4 rows per step, one pass each over the same trace.
    assert stats.get("replayed", 0) >= (7 if mode == "always" else 6), stats


def test_non_persistent_tape_consumed_after_replay():
    with _in_mode("always"):
        chain(fasttape.GradientTape, 0)
        x = tf.constant([1.0, 2.0])
        with fasttape.GradientTape() as t:
            t.watch(x)
            y = tf.sin(x) * x
        t.gradient(y, x)
        with pytest.raises(RuntimeError):
            t.gradient(y, x)


# -- where the compiled path must not run -------------------------------------------

def custom_gradient(Tape, step):
    @tf.custom_gradient
    def f(x):
        def grad(dy):
            return dy * float(step + 1)   # per-step state in a closure
        return tf.identity(x), grad

    x = _f32(_rng(step), 3)
    with Tape() as t:
        t.watch(x)
        y = tf.reduce_sum(f(x) * x)
    return t.gradient(y, x)


def second_order(Tape, step):
    x = _f32(_rng(step), 3)
    with Tape() as outer:
        outer.watch(x)
        with Tape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(tf.sin(x) * x)
        g = inner.gradient(y, x)
    return g, outer.gradient(g, x)


def test_custom_gradient_not_compiled(mode):
    stats = _run(custom_gradient)
    assert stats.get("skipped") == STEPS, stats
    assert not stats.get("replayed") and not stats.get("built"), stats


def test_recorded_backward_not_compiled(mode):
    # The inner pass is recorded by the outer tape: always eager. The outer
    # one, recorded by nothing, may be compiled.
    stats = _run(second_order)
    assert stats.get("skipped") == STEPS, stats
    _assert_replayed(stats, mode)


def test_not_compiled_while_profiling():
    with _in_mode("always"):
        with fasttape.profile():
            stats = _run(chain)
    assert stats == {"skipped": STEPS}, stats


def test_mode_off():
    with _in_mode("off"):
        stats = _run(chain)
    assert stats == {"skipped": STEPS}, stats


def test_bad_mode_is_a_value_error():
    with pytest.raises(ValueError):
        _compiled.set_mode("sometimes")


def test_disagreeing_pass_is_never_used(monkeypatch):
    """A compiled pass whose result differs from the eager one on the step
    it is built is thrown away for good; results stay TF's."""
    monkeypatch.setattr(_compiled, "_same", lambda a, b: False)
    with _in_mode("always"):
        stats = _run(chain)
    assert stats.get("failed") == 1 and not stats.get("replayed"), stats
    assert stats.get("skipped") == STEPS - 1, stats


def test_same_detects_differences():
    a = [tf.constant([1.0, 2.0]), None]
    assert _compiled._same(a, [tf.constant([1.0, 2.0]), None])
    assert not _compiled._same(a, [tf.constant([1.0, 2.001]), None])
    assert not _compiled._same(a, [None, None])
    assert not _compiled._same(a, [tf.constant([1.0, 2.0], tf.float64), None])
    assert not _compiled._same(
        a, [tf.IndexedSlices(tf.constant([1.0, 2.0]), tf.constant([0, 1]),
                             tf.constant([2])), None])


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_compiled, "_MAX_ENTRIES", 2)
    with _in_mode("always"):
        for n in range(2, 6):
            x = tf.ones([n])
            with fasttape.GradientTape() as t:
                t.watch(x)
                y = tf.sin(x)
            t.gradient(y, x)
        assert len(_compiled.CACHE.compiled) == 2


def test_slower_pass_stays_eager(monkeypatch):
    """A compiled pass that is no faster than the eager one is not used."""
    monkeypatch.setattr(_compiled.CACHE, "keep_faster", True)
    ticks = iter(range(1000))
    # Each perf_counter() call advances one second: the eager pass and the
    # timed compiled call both take 1 s, so the compiled one is no faster.
    monkeypatch.setattr(_compiled.time, "perf_counter", lambda: next(ticks))
    with _in_mode("always"):
        stats = _run(chain)
    assert stats.get("slower") == 1 and not stats.get("replayed"), stats


def test_executor_falls_back_to_the_default(monkeypatch):
    """Where TF's single-threaded executor refuses a pass, the default
    executor runs it."""
    call = _compiled._Compiled.__call__

    def refusing(self, feeds):
        if self.executor_type == "SINGLE_THREADED_EXECUTOR":
            raise tf.errors.UnimplementedError(None, None, "refused")
        return call(self, feeds)

    monkeypatch.setattr(_compiled._Compiled, "__call__", refusing)
    with _in_mode("always"):
        stats = _run(chain)
        executors = [c.executor_type for c in _compiled.CACHE.compiled.values()]
    assert executors == [""], executors
    _assert_replayed(stats, "always")


@pytest.mark.parametrize("default_faster", [True, False])
def test_large_kernels_pick_the_faster_executor(monkeypatch, default_faster):
    """A pass slow enough per op is timed on both executors when it is
    built and keeps the faster (by the margin); its replays then give TF's
    gradients on it."""
    monkeypatch.setattr(_compiled.CACHE, "keep_faster", True)
    monkeypatch.setattr(_compiled, "TRY_DEFAULT_EXECUTOR_SECONDS_PER_OP", 0.0)
    # (both faster than any eager pass)
    seconds = {"SINGLE_THREADED_EXECUTOR": 2e-9,
               "": 1e-9 if default_faster else 1.98e-9}
    warm = _compiled._warm_seconds
    monkeypatch.setattr(_compiled, "_warm_seconds", lambda c, feeds: (
        warm(c, feeds), seconds[c.executor_type])[1])
    with _in_mode("auto"):
        stats = _run(chain, steps=8)
        executors = [c.executor_type for c in _compiled.CACHE.compiled.values()]
    assert executors == (["" if default_faster else "SINGLE_THREADED_EXECUTOR"]), executors
    assert stats.get("default_executor", 0) == int(default_faster), stats
    assert stats.get("replayed", 0) >= 3, stats


def test_small_kernels_keep_the_single_threaded_executor(monkeypatch):
    """A pass of small kernels is not timed on the default executor."""
    monkeypatch.setattr(_compiled.CACHE, "keep_faster", True)
    tried, switched = [], []
    pick = _compiled._pick_executor
    monkeypatch.setattr(_compiled, "_pick_executor", lambda c, f, s, n: (
        tried.append(s / n), pick(c, f, s, n))[1])
    use = _compiled._Compiled.use_executor
    monkeypatch.setattr(_compiled._Compiled, "use_executor", lambda self, e: (
        switched.append(e), use(self, e))[1])
    with _in_mode("auto"):
        stats = _run(chain)
        executors = [c.executor_type for c in _compiled.CACHE.compiled.values()]
    assert tried and all(
        t < _compiled.TRY_DEFAULT_EXECUTOR_SECONDS_PER_OP for t in tried), tried
    assert not stats.get("default_executor"), stats
    assert "" not in switched, switched     # never instantiated there
    assert set(executors) <= {"SINGLE_THREADED_EXECUTOR", _compiled._FAILED}


def unrolled_bias_loop(Tape, step):
    rng = _rng(step)
    x, b = _f32(rng, 2, 2), _f32(rng, 2)
    with Tape() as tape:
        tape.watch([x, b])
        y = x
        for _ in range(12):
            y = tf.tanh(y + b)
    return tape.gradient(y, [x, b])


def test_passes_are_pruned_by_grappler_alone():
    """A compiled pass is instantiated with Grappler's model pruner and
    its other optimizers off: what no output needs (here the arguments
    TanhGrad and AddV2's gradient do not read, and Identity nodes) is not
    run (TF's graph after optimization, from its run metadata), and its
    gradients are still TF's, bit for bit."""
    from tensorflow.python.eager import context
    ctx = context.context()
    with _in_mode("always"):
        ctx.enable_run_metadata()
        try:
            stats = _run(unrolled_bias_loop)
            metadata = ctx.export_run_metadata()
        finally:
            ctx.disable_run_metadata()
        compiled = list(_compiled.CACHE.compiled.values())
    _assert_replayed(stats, "always")
    # (The eager ops' one-op functions are listed too.)
    graphs = [g for g in metadata.function_graphs
              if sum(n.op == "TanhGrad" for n in g.pre_optimization_graph.node) > 1]
    assert graphs, "the compiled pass ran no function graph"
    for g in graphs:
        def count(graph, op):
            return sum(n.op == op for n in graph.node)
        pre, post = g.pre_optimization_graph, g.post_optimization_graph
        assert count(post, "_Arg") < count(pre, "_Arg"), (
            count(pre, "_Arg"), count(post, "_Arg"))
        assert count(pre, "Identity") and not count(post, "Identity")
        assert count(post, "TanhGrad") == count(pre, "TanhGrad") == 12
    toggles = type(tf.compat.v1.ConfigProto().graph_options.rewrite_options)
    for c in compiled:
        attrs = dict(zip(c.attrs[::2], c.attrs[1::2]))
        config = tf.compat.v1.ConfigProto.FromString(attrs["config_proto"])
        rewrites = config.graph_options.rewrite_options
        assert not rewrites.disable_meta_optimizer
        assert not rewrites.disable_model_pruning
        for name in ("arithmetic_optimization", "common_subgraph_elimination",
                     "constant_folding", "remapping", "layout_optimizer",
                     "loop_optimization", "function_optimization",
                     "debug_stripper", "dependency_optimization"):
            assert getattr(rewrites, name) == toggles.OFF, name


def test_config_input_names_are_op_input_names():
    """Every name in the list names an input of some registered op (an attr
    name there would silently bake nothing)."""
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.client import pywrap_tf_session as c_api
    ops = op_def_pb2.OpList()
    ops.ParseFromString(c_api.TF_GetBuffer(c_api.TF_GetAllOpList()))
    names = {a.name for op in ops.op for a in op.input_arg}
    assert _compiled.CONFIG_INPUT_NAMES <= names
    assert _compiled.config_inputs_of("ConcatV2") == frozenset({-1})
    assert _compiled.config_inputs_of("GatherV2") == frozenset({2})


def test_cache_keeps_no_tensor_of_the_steps():
    """A cached pass holds a graph function only: the tape and the saved
    tensors of the step it was built on, and of the steps replaying it, are
    freed."""
    import gc
    import weakref

    def step():
        x = tf.constant([1.0, 2.0])
        with fasttape.GradientTape() as t:
            t.watch(x)
            a = x * 3.0
            y = tf.sin(a) * x
        refs = weakref.ref(t._tape), weakref.ref(a)
        t.gradient(y, x)
        return refs

    with _in_mode("always"):
        for _ in range(2):
            refs = step()
            gc.collect()
            assert all(r() is None for r in refs)
        assert _compiled.CACHE.stats["replayed"] == 1


# -- when auto builds: the cost model (see _compiled's docstring) ---------------------

def _cache(calls=0):
    cache = _compiled._Cache("auto")
    cache.calls = calls
    return cache


def _used(cache, seen, calls):
    for call in calls:
        cache.calls = call
        seen.use(call)


def test_a_key_seen_once_is_never_built():
    cache = _cache()
    seen = _compiled._Seen(0, cache.epoch)
    _used(cache, seen, [0])
    seen.eager_seconds = 10.0        # however slow its eager pass
    assert not cache.worth_building(seen, 1)


@pytest.mark.parametrize("gap", [1, 2], ids=["one_key", "two_keys_in_turn"])
def test_a_steady_key_is_built_at_its_fourth_use(gap):
    """A fixed-shape loop (uses at equal gaps) is expected to go on for
    HORIZON calls: a 400-op pass that saves 13 ms a step is built once three
    gaps are equal; two are not enough. The same for a loop over a few keys
    (A, B, A, B, A, B, A: the same gap three times)."""
    cache = _cache()
    seen = _compiled._Seen(0, cache.epoch)
    seen.eager_seconds = 0.02
    _used(cache, seen, [0, gap, 2 * gap])
    assert not seen.steady and not cache.worth_building(seen, 400)
    _used(cache, seen, [3 * gap])
    assert seen.steady and cache.worth_building(seen, 400)


def test_a_steady_rnn_pass_is_built_before_any_build_is_measured():
    """The bench's RNN (322 backward ops, 3.6 ms eager, 0.15 s to build) in
    a fresh process, where the estimates are still the defaults: a
    fixed-shape loop over it is built at its fourth use (the default of 2
    ms an op estimated 0.65 s, more than HORIZON uses save, and it ran
    eagerly for good)."""
    cache = _cache()
    seen = _compiled._Seen(0, cache.epoch)
    seen.eager_seconds = 0.0036
    _used(cache, seen, [0, 1, 2, 3])
    assert seen.steady and cache.worth_building(seen, 322)


@pytest.mark.parametrize("gap", [1, 2, 4])
def test_a_small_pass_used_in_turn_pays_as_in_a_loop_of_its_own(gap):
    """A step of a few gradient calls in turn (a GAN's two updates, a plain
    and a DP-SGD step: A, B, A, B...) repeats each as a loop of one does:
    HORIZON steps ahead are HORIZON uses of each. A small pass (11 ops, 0.35
    ms eager: 0.23 ms saved a use against a 27 ms build) is built at its
    fourth use alone and in turn with others; it was left eager at gap 2
    (its rate halved the uses expected), for 126 uses."""
    cache = _cache()
    seen = _compiled._Seen(0, cache.epoch)
    seen.eager_seconds = 0.00035
    _used(cache, seen, [0, gap, 2 * gap])
    assert not cache.worth_building(seen, 11)
    _used(cache, seen, [3 * gap])
    assert seen.steady and cache.worth_building(seen, 11)


def test_a_key_at_larger_equal_gaps_is_held_to_horizon_calls():
    """Equal gaps longer than MAX_KEYS_IN_TURN: HORIZON calls ahead, at
    the key's rate (a length drawn from many can repeat so by chance)."""
    cache = _cache()
    seen = _compiled._Seen(0, cache.epoch)
    seen.eager_seconds = 0.00035
    gap = _compiled.MAX_KEYS_IN_TURN + 4
    _used(cache, seen, [0, gap, 2 * gap, 3 * gap])
    assert seen.steady
    assert cache.uses_ahead(seen) == pytest.approx(4 / (3 * gap + 1) * _compiled.HORIZON)
    assert not cache.worth_building(seen, 11)


def test_a_drawn_length_repeating_at_equal_gaps_twice_is_not_steady():
    """A sequence length drawn at random each step often comes back at
    equal gaps twice (uses at 0, 3, 6): betting on HORIZON uses ahead
    there built passes that never paid (the bench's varlen_rnn)."""
    cache = _cache()
    seen = _compiled._Seen(0, cache.epoch)
    seen.eager_seconds = 0.02
    _used(cache, seen, [0, 3, 6])
    assert not seen.steady and not cache.worth_building(seen, 400)
    _used(cache, seen, [8])          # and an unequal gap starts over
    assert not seen.steady


def test_an_irregular_key_waits_until_its_uses_paid_for_the_build():
    """A key whose uses come at irregular gaps (a sequence length drawn
    each step) is expected to be used as often again as so far: it is
    built once its uses, times what compiling saves each, reach the
    estimated build cost (0.805 s for 400 ops; 12 ms saved per use)."""
    cache = _cache()
    seen = _compiled._Seen(0, cache.epoch)
    seen.eager_seconds = 0.02
    call, gap, built_at = 0, 1, None
    for use in range(1, 200):
        _used(cache, seen, [call])
        if use > 2:
            assert not seen.steady
        if cache.worth_building(seen, 400):
            built_at = use
            break
        gap = 3 if gap != 3 else 5
        call += gap
    saving = min(0.02 * (1 - _compiled._COMPILED_SHARE),
                 400 * _compiled._SAVING_PER_ENTRY)
    build = _compiled._BUILD_FIXED + 400 * _compiled._BUILD_PER_ENTRY
    assert built_at == int(np.ceil(build / saving))


def test_kernel_cache_clears_count_as_instantiations():
    """A key used once per re-seed (each use instantiates its pass again)
    is never built, however steady; one re-seed per 100 uses is fine."""
    cache = _cache()
    seen = _compiled._Seen(0, cache.epoch)
    seen.eager_seconds = 0.02
    for call in range(10):
        cache.kernels_cleared()
        _used(cache, seen, [call])
        assert not cache.worth_building(seen, 400)
    cache = _cache()
    seen = _compiled._Seen(0, cache.epoch)
    seen.eager_seconds = 0.02
    _used(cache, seen, range(100))
    cache.kernels_cleared()
    assert cache.worth_building(seen, 400)


def test_a_cleared_pass_is_instantiated_only_where_it_pays():
    cache = _cache()
    compiled = types.SimpleNamespace(seen=_compiled._Seen(0, cache.epoch),
                                     saving=0.01, instantiation_seconds=0.5)
    _used(cache, compiled.seen, range(100))
    cache.kernels_cleared()      # one clear in 100 uses: 100 uses ahead
    assert cache.worth_instantiating(compiled)
    for call in range(100, 110):  # now a clear before every use
        cache.kernels_cleared()
        _used(cache, compiled.seen, [call])
    # 110 uses over 11 clears: 10 uses ahead save 0.1 s, less than 0.5 s.
    assert not cache.worth_instantiating(compiled)
    compiled.instantiation_seconds = 0.05
    assert cache.worth_instantiating(compiled)


def test_cost_estimates_learn_from_measured_builds():
    cache = _cache()
    cache.learn_build(100, 0.5, 0.5)
    assert cache.per_entry > _compiled._BUILD_PER_ENTRY
    assert cache.build_seconds == 1.0
    assert cache.instantiation_share > _compiled._INSTANTIATION_SHARE
    # Pooled: one odd small pass (a slow moment) moves them little.
    per_entry = cache.per_entry
    cache.learn_build(4, 1.0, 0.0)
    assert per_entry < cache.per_entry < 2 * per_entry


@pytest.fixture
def weighing_costs(monkeypatch):
    # fasttape's hooks go in with its first tape; these tests re-seed first.
    _recording.install()
    monkeypatch.setattr(_compiled.CACHE, "keep_faster", True)
    with _in_mode("auto"):
        yield _compiled.CACHE


def _rnn_steps(lengths, reseed=False):
    """A tanh RNN over the given lengths, TF and fasttape compared."""
    rng = np.random.default_rng(3)
    w = tf.constant(rng.normal(0, 0.3, (4, 4)).astype("float32"))

    def program(Tape, step):
        if reseed:
            tf.random.set_seed(step)
        x = _f32(_rng(step), 2, 4)
        with Tape() as t:
            t.watch(w)
            h = x
            for _ in range(lengths[step]):
                h = tf.tanh(tf.matmul(h, w))
            y = tf.reduce_sum(h * h)
        return t.gradient(y, w)

    return _run(program, steps=len(lengths))


def test_lengths_that_never_repeat_are_never_built(weighing_costs):
    stats = _rnn_steps([3, 4, 5, 6, 7, 8])
    assert stats == {"new_keys": 6, "eager": 6}, stats


def test_a_fixed_shape_loop_is_built_at_its_fourth_step(weighing_costs):
    stats = _rnn_steps([30] * 5)
    assert stats.get("built", 0) + stats.get("slower", 0) == 1, stats
    assert stats["eager"] == 3, stats
    if stats.get("built"):        # (a slower pass stays eager: not replayed)
        assert stats.get("replayed") == 1, stats


def test_a_fixed_shape_loop_over_the_size_cap_is_never_built(weighing_costs,
                                                             monkeypatch):
    """A pass of more backward ops than _MAX_BUILT_ENTRIES runs eagerly at
    every step (tracing one holds about 40 KB an op), unkeyed; one at the
    cap is built as any other."""
    monkeypatch.setattr(_compiled, "_MAX_BUILT_ENTRIES", 60)
    stats = _rnn_steps([31] * 6)    # 31 matmul + 31 tanh + the sum's ops
    assert stats == {"too_large": 6}, stats
    monkeypatch.setattr(_compiled, "_MAX_BUILT_ENTRIES", 10_000)
    stats = _rnn_steps([31] * 6)
    assert stats.get("built", 0) + stats.get("slower", 0) == 1, stats


def test_churning_keys_are_computed_on_one_call_in_four(weighing_costs):
    """After _CHURN_CALLS calls in a row that neither replayed nor built,
    three calls in four skip the key (and run eagerly at once)."""
    n = _compiled._CHURN_CALLS + 8
    stats = _rnn_steps(list(range(1, n + 1)))
    skipped = 8 - 8 // _compiled._CHURN_SAMPLE
    assert stats == {"new_keys": n - skipped, "eager": n - skipped,
                     "churn_skipped": skipped}, stats


def test_a_fixed_shape_loop_after_churn_is_still_built(weighing_costs):
    """Keys sampled one call in four still show a steady key (equal gaps
    in keyed calls); once it replays, every call is keyed again."""
    churn = list(range(1, _compiled._CHURN_CALLS + 2))
    stats = _rnn_steps(churn + [30] * 24)
    assert stats.get("built", 0) + stats.get("slower", 0) == 1, stats
    if stats.get("built"):
        assert stats.get("replayed", 0) >= 4, stats


def test_reseeding_is_counted_through_tfs_clear_caches(weighing_costs, monkeypatch):
    """tf.random.set_seed calls TFE_ContextClearCaches, which fasttape's
    hook counts (without the hook it is not)."""
    from tensorflow.python import pywrap_tfe
    from tensorflow.python.eager import context
    context.ensure_initialized()   # (before, set_seed clears nothing)
    epoch = weighing_costs.epoch
    tf.random.set_seed(1)
    assert weighing_costs.epoch == epoch + 1
    monkeypatch.setattr(pywrap_tfe, "TFE_ContextClearCaches",
                        _recording._originals["TFE_ContextClearCaches"])  # pylint: disable=protected-access
    tf.random.set_seed(2)
    assert weighing_costs.epoch == epoch + 1


def test_a_loop_reseeded_every_step_is_never_built(weighing_costs):
    stats = _rnn_steps([30] * 5, reseed=True)
    assert stats.get("kernel_clears") == 10, stats   # TF's step and fasttape's
    assert not stats.get("built") and stats["eager"] == 5, stats


def test_a_cleared_pass_runs_eagerly_or_is_instantiated_again(weighing_costs, monkeypatch):
    """Parity either way, and the counters say which ran."""
    monkeypatch.setattr(_compiled.CACHE, "keep_faster", False)
    _run(chain, steps=2)
    (compiled,) = _compiled.CACHE.compiled.values()
    monkeypatch.setattr(_compiled.CACHE, "keep_faster", True)
    compiled.saving, compiled.instantiation_seconds = 1e-9, 10.0
    tf.random.set_seed(0)
    stats = _run(chain, steps=1)
    assert stats == {"eager_after_clear": 1}, stats
    compiled.saving, compiled.instantiation_seconds = 1.0, 0.1
    stats = _run(chain, steps=2)
    assert stats == {"reinstantiated": 1, "replayed": 2}, stats


def test_keys_remembered_are_bounded_and_emptied(weighing_costs, monkeypatch):
    monkeypatch.setattr(_compiled, "_MAX_COUNTS", 3)
    _rnn_steps([1, 2, 3, 4, 5])
    assert 0 < len(_compiled.CACHE.seen) <= 3
    assert _compiled.CACHE.calls == 5
    fasttape.clear_caches()
    assert not _compiled.CACHE.seen and not _compiled.CACHE.stats
    assert _compiled.CACHE.calls == 0


# -- the bench's variable-shape workloads: every step's gradients as TF's ------------

@pytest.mark.parametrize("name", ["varlen_rnn", "varlen_attention",
                                  "last_batch", "policy_gradient"])
def test_variable_shape_workloads_match_tf(mode, name):
    from fasttape import bench

    class Impl:
        def __init__(self, Tape):
            self.GradientTape = Tape

    _, record = bench.BY_NAME[name].make(tf)
    tf_impl, ft_impl = Impl(tf.GradientTape), Impl(fasttape.GradientTape)
    steps = 18 if name == "last_batch" else 8
    _compiled.CACHE.stats.clear()
    for step in range(steps):
        assert_same(record(tf_impl)(), record(ft_impl)(), path=f"step {step}")
    stats = _compiled.CACHE.stats
    assert not stats.get("failed"), stats
    if mode == "always" or name == "last_batch":
        assert stats.get("replayed"), stats


def test_the_bench_times_variable_workloads_over_the_cache_horizon():
    """The cache builds a pass when it pays back over HORIZON calls; the
    bench's variable-shape workloads are judged over as many steps."""
    from fasttape import bench
    assert bench.VARIABLE_STEPS == _compiled.HORIZON


def test_every_counter_of_a_cached_call_counts_in_the_hit_rate(weighing_costs):
    """The bench's hit rate divides by the calls the cache saw: churn-skipped
    calls are among them (they were left out, and varlen_rnn read 24%
    replayed where 20% of its calls were)."""
    n = _compiled._CHURN_CALLS + 8
    stats = _rnn_steps(list(range(1, n + 1)))
    assert sum(stats.get(k, 0) for k in _compiled.CALL_STATS) == n, stats
    assert set(stats) - {"new_keys"} <= set(_compiled.CALL_STATS), stats
