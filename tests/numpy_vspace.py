"""A tiny NumPy autodiff framework on top of fasttape's core, for tests only.

No TensorFlow here: the core is framework-agnostic, and these tests check it
against NumPy arithmetic alone.

Pieces:
  T                a tensor: a NumPy array plus a unique, increasing int id.
  TAPES/ACCUMULATORS
                   the active GradientTapeCore tapes and ForwardAccumulatorCore
                   accumulators (``tape()``, ``forward_accumulator()``,
                   ``stop_recording()`` push and pop them).
  ops              add, sub, mul, neg, sin, cos, exp, matmul, transpose,
                   reduce_sum, broadcast_to, identity, sincos and split2 (two
                   outputs), concat, round_ (float, no gradient), to_int
                   (integer output). Each computes with NumPy, wraps its
                   outputs as T, then records itself on every tape and
                   accumulator that wants it.
  gradient rules   written with the same ops, so running one under a tape
                   records it: higher orders, and the accumulator's fallback
                   (transposing a backward function under an inner tape)
                   work.
  NumpyVSpace      the core's VSpace, with call counters and logs so tests
                   can see what the core asked for.
  checkers         central-difference numerical gradients and a checker
                   that raises GradientMismatch.

Recording order: an op is recorded on the tapes first, then accumulated by
the accumulators, so the ops a forward rule runs already see the op's
outputs on the tapes (backward-over-forward works even for rules that read
an op's outputs).
"""

import contextlib
import functools
import importlib.util
import itertools
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np


def _load_core():
    """fasttape._core without running fasttape/__init__.py (which imports
    TensorFlow). FASTTAPE_CORE_SO names another build of the extension (the
    mutation runs use it)."""
    mod = sys.modules.get("fasttape._core")
    if mod is not None:
        return mod
    path = os.environ.get("FASTTAPE_CORE_SO")
    if not path:
        spec = importlib.util.find_spec("fasttape")  # does not execute it
        dirs = list(spec.submodule_search_locations) if spec else []
        dirs.append(str(Path(__file__).resolve().parent.parent / "fasttape"))
        found = []
        for d in dirs:
            found += sorted(Path(d).glob("_core.*.so")) + sorted(Path(d).glob("_core.*.pyd"))
        if not found:
            raise ImportError("fasttape._core is not built (pip install -e .)")
        path = str(found[0])
    spec = importlib.util.spec_from_file_location("fasttape._core", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fasttape._core"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["fasttape._core"]
        raise
    return mod


core = _load_core()
GradientTapeCore = core.GradientTapeCore
ForwardAccumulatorCore = core.ForwardAccumulatorCore


# -- tensors --------------------------------------------------------------

_next_id = itertools.count(1)


class T:
    """A NumPy array with a unique, never reused, increasing id."""

    __slots__ = ("value", "id", "__weakref__")

    def __init__(self, value, dtype=None):
        arr = np.array(value, dtype=dtype)
        if dtype is None and arr.dtype.kind in "iub" and not isinstance(value, np.ndarray):
            arr = arr.astype(np.float64)  # python numbers: float tensors
        self.value = arr
        self.id = next(_next_id)

    @property
    def shape(self):
        return self.value.shape

    @property
    def dtype(self):
        return self.value.dtype

    @property
    def meta(self):
        return (self.value.shape, self.value.dtype)

    @property
    def trainable(self):
        return self.value.dtype.kind in "fc"

    def __repr__(self):
        return f"T#{self.id}({self.value!r})"


class Payload:
    """The backward payload of one op; weakref-able so tests can watch it
    being released."""

    __slots__ = ("op_type", "inputs", "outputs", "attrs", "__weakref__")

    def __init__(self, op_type, inputs, outputs, attrs):
        self.op_type = op_type
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.attrs = dict(attrs or {})

    def __iter__(self):
        return iter((self.inputs, self.outputs, self.attrs))


# -- the active recorders -------------------------------------------------

TAPES = []
ACCUMULATORS = []
STATS = Counter()  # payloads built, ops run: for tests that count


@contextlib.contextmanager
def tape(persistent=False, watch=()):
    t = GradientTapeCore(persistent)
    for x in watch:
        t.watch(x.id)
    TAPES.append(t)
    try:
        yield t
    finally:
        if t in TAPES:
            TAPES.remove(t)


@contextlib.contextmanager
def forward_accumulator(vspace, primals=(), tangents=(), use_batch=False):
    acc = ForwardAccumulatorCore(vspace, use_batch)
    for p, v in zip(primals, tangents):
        acc.watch(p.id, v if isinstance(v, T) else T(v))
    ACCUMULATORS.append(acc)
    try:
        yield acc
    finally:
        if acc in ACCUMULATORS:
            ACCUMULATORS.remove(acc)


@contextlib.contextmanager
def stop_recording():
    saved = TAPES[:], ACCUMULATORS[:]
    TAPES.clear()
    ACCUMULATORS.clear()
    try:
        yield
    finally:
        TAPES[:], ACCUMULATORS[:] = saved


def reset():
    """Drop every active recorder (test isolation)."""
    TAPES.clear()
    ACCUMULATORS.clear()
    STATS.clear()


def _record(op_type, inputs, outputs, attrs=None):
    STATS["ops_run"] += 1
    if not TAPES and not ACCUMULATORS:
        return
    in_ids = [x.id for x in inputs]
    trainable = [x.trainable for x in inputs]
    out_ids = [o.id for o in outputs]
    out_meta = tuple(o.meta for o in outputs)
    payload = None
    for t in list(TAPES):
        if t.should_record(in_ids, trainable):
            if payload is None:
                payload = Payload(op_type, inputs, outputs, attrs)
                STATS["payloads"] += 1
            t.record_operation(op_type, in_ids, out_ids, out_meta, payload, trainable)
    if ACCUMULATORS:
        in_meta = tuple(x.meta for x in inputs)
        for acc in list(ACCUMULATORS):
            if acc.should_record(in_ids, trainable):
                if payload is None:
                    payload = Payload(op_type, inputs, outputs, attrs)
                    STATS["payloads"] += 1
                acc.accumulate(op_type, in_ids, in_meta, out_ids, out_meta,
                               payload, trainable)


def _op(op_type, inputs, values, attrs=None):
    outputs = [T(v, dtype=np.asarray(v).dtype) for v in values]
    _record(op_type, inputs, outputs, attrs)
    return outputs


# -- ops ------------------------------------------------------------------

def add(a, b):
    return _op("add", [a, b], [a.value + b.value])[0]


def sub(a, b):
    return _op("sub", [a, b], [a.value - b.value])[0]


def mul(a, b):
    return _op("mul", [a, b], [a.value * b.value])[0]


def neg(a):
    return _op("neg", [a], [-a.value])[0]


def sin(a):
    return _op("sin", [a], [np.sin(a.value)])[0]


def cos(a):
    return _op("cos", [a], [np.cos(a.value)])[0]


def exp(a):
    return _op("exp", [a], [np.exp(a.value)])[0]


def identity(a):
    return _op("identity", [a], [a.value.copy()])[0]


def matmul(a, b):
    return _op("matmul", [a, b], [a.value @ b.value])[0]


def transpose(a):
    return _op("transpose", [a], [a.value.T.copy()])[0]


def reduce_sum(a):
    """Sum of all elements: a scalar."""
    return _op("reduce_sum", [a], [np.sum(a.value)])[0]


def broadcast_to(a, shape):
    """A scalar repeated into ``shape``."""
    shape = tuple(shape)
    return _op("broadcast_to", [a], [np.broadcast_to(a.value, shape).copy()],
               {"shape": shape})[0]


def sincos(a):
    """Two outputs: (sin a, cos a)."""
    s, c = _op("sincos", [a], [np.sin(a.value), np.cos(a.value)])
    return s, c


def split2(a, at=None):
    """A vector cut in two at ``at`` (default: the middle)."""
    n = a.value.shape[0]
    at = n // 2 if at is None else at
    x, y = _op("split2", [a], [a.value[:at].copy(), a.value[at:].copy()], {"at": at})
    return x, y


def concat(a, b):
    return _op("concat", [a, b], [np.concatenate([a.value, b.value])])[0]


def round_(a):
    """Float in, float out, no gradient (as TF's Round)."""
    return _op("round", [a], [np.round(a.value)])[0]


def to_int(a):
    """Integer output: ops reading it see a non-trainable input."""
    return _op("to_int", [a], [np.floor(a.value).astype(np.int64)])[0]


def zeros(shape, dtype=np.float64):
    return T(np.zeros(shape, dtype=dtype))


def ones(shape, dtype=np.float64):
    return T(np.ones(shape, dtype=dtype))


# -- gradient rules (with the same ops, so they record) ---------------------
#
# rule(payload, unneeded, out_grads) -> one gradient or None per input.
# out_grads entries may be None (none_ok_indices, or the accumulator's
# fallback which runs with build_default_zeros=False): None means zero.

def _single(fn):
    @functools.wraps(fn)
    def rule(p, unneeded, out_grads):
        g = out_grads[0]
        if g is None:
            return [None] * len(p.inputs)
        res = fn(p, g)
        return [None if i in unneeded else r for i, r in enumerate(res)]
    return rule


def _sum_terms(terms):
    terms = [t for t in terms if t is not None]
    if not terms:
        return None
    return functools.reduce(add, terms)


@_single
def _g_add(p, g):
    return [g, g]


@_single
def _g_sub(p, g):
    return [g, neg(g)]


def _g_mul(p, unneeded, out_grads):
    g = out_grads[0]
    if g is None:
        return [None, None]
    a, b = p.inputs
    return [None if 0 in unneeded else mul(g, b),
            None if 1 in unneeded else mul(g, a)]


@_single
def _g_neg(p, g):
    return [neg(g)]


@_single
def _g_sin(p, g):
    return [mul(g, cos(p.inputs[0]))]


@_single
def _g_cos(p, g):
    return [neg(mul(g, sin(p.inputs[0])))]


@_single
def _g_exp(p, g):
    return [mul(g, p.outputs[0])]


@_single
def _g_identity(p, g):
    return [g]


def _g_matmul(p, unneeded, out_grads):
    g = out_grads[0]
    if g is None:
        return [None, None]
    a, b = p.inputs
    return [None if 0 in unneeded else matmul(g, transpose(b)),
            None if 1 in unneeded else matmul(transpose(a), g)]


@_single
def _g_transpose(p, g):
    return [transpose(g)]


@_single
def _g_reduce_sum(p, g):
    return [broadcast_to(g, p.inputs[0].shape)]


@_single
def _g_broadcast_to(p, g):
    return [reduce_sum(g)]


def _g_sincos(p, unneeded, out_grads):
    gs, gc = out_grads
    a = p.inputs[0]
    return [_sum_terms([None if gs is None else mul(gs, cos(a)),
                        None if gc is None else neg(mul(gc, sin(a)))])]


def _g_split2(p, unneeded, out_grads):
    gx, gy = out_grads
    if gx is None and gy is None:
        return [None]
    x, y = p.outputs
    return [concat(zeros(x.shape, x.dtype) if gx is None else gx,
                   zeros(y.shape, y.dtype) if gy is None else gy)]


def _g_concat(p, unneeded, out_grads):
    g = out_grads[0]
    if g is None:
        return [None, None]
    a, _ = p.inputs
    ga, gb = split2(g, at=a.shape[0])
    return [None if 0 in unneeded else ga, None if 1 in unneeded else gb]


def _g_none(p, unneeded, out_grads):
    return [None] * len(p.inputs)


GRADIENTS = {
    "add": _g_add, "sub": _g_sub, "mul": _g_mul, "neg": _g_neg,
    "sin": _g_sin, "cos": _g_cos, "exp": _g_exp, "identity": _g_identity,
    "matmul": _g_matmul, "transpose": _g_transpose,
    "reduce_sum": _g_reduce_sum, "broadcast_to": _g_broadcast_to,
    "sincos": _g_sincos, "split2": _g_split2, "concat": _g_concat,
    "round": _g_none, "to_int": _g_none,
}


# -- direct forward rules (the others go through the core's fallback) -------

def _f_mul(p, tangents, use_batch):
    a, b = p.inputs
    ta, tb = tangents
    return [_sum_terms([None if ta is None else mul(ta, b),
                        None if tb is None else mul(a, tb)])]


def _f_sin(p, tangents, use_batch):
    (t,) = tangents
    return [None if t is None else mul(cos(p.inputs[0]), t)]


def _f_add(p, tangents, use_batch):
    return [_sum_terms(tangents)]


FORWARD_RULES = {"mul": _f_mul, "sin": _f_sin, "add": _f_add}


# -- the VSpace -------------------------------------------------------------

class BackwardCall:
    """One call_backward as the core made it (values copied, never the
    payload: the log must not keep payloads alive)."""

    __slots__ = ("op_type", "unneeded", "out_grads")

    def __init__(self, op_type, unneeded, out_grads):
        self.op_type = op_type
        self.unneeded = list(unneeded)
        self.out_grads = [None if g is None else np.array(g.value) for g in out_grads]

    def __repr__(self):
        return f"BackwardCall({self.op_type!r}, unneeded={self.unneeded}, out_grads={self.out_grads})"


class NumpyVSpace(core.VSpace):
    """The core's VSpace for T tensors.

    calls            Counter: "call_backward", "bw:<op>", "aggregate",
                     "num_elements", "element_size", "ones_like",
                     "zeros_like", "forward_rule", "rule:<op>", "fallback",
                     "unbatch", "batch".
    backward_log     a BackwardCall per call_backward.
    aggregate_sizes  len(grads) of each aggregate call.
    overrides        op_type -> gradient rule, replacing GRADIENTS' one.
    forward_rules    False: every forward_rule answers NotImplemented.
    fake_num_elements  answer of num_elements when set (cheap early
                     aggregation tests).
    on_backward, on_forward  optional hooks called first with the core's
                     arguments.
    """

    def __init__(self, none_ok_indices=None, forward_rules=True):
        super().__init__(none_ok_indices)
        self.calls = Counter()
        self.backward_log = []
        self.aggregate_sizes = []
        self.overrides = {}
        self.forward_rules = forward_rules
        self.fake_num_elements = None
        self.on_backward = None
        self.on_forward = None

    def num_elements(self, grad):
        self.calls["num_elements"] += 1
        if self.fake_num_elements is not None:
            return self.fake_num_elements
        return int(grad.value.size)

    def element_size(self, grad):
        self.calls["element_size"] += 1
        return int(grad.value.itemsize)

    def aggregate(self, grads):
        self.calls["aggregate"] += 1
        self.aggregate_sizes.append(len(grads))
        return functools.reduce(add, grads)

    def call_backward(self, op_type, payload, unneeded_indices, out_grads):
        self.calls["call_backward"] += 1
        self.calls["bw:" + op_type] += 1
        self.backward_log.append(BackwardCall(op_type, unneeded_indices, out_grads))
        if self.on_backward is not None:
            self.on_backward(op_type, payload, unneeded_indices, out_grads)
        rule = self.overrides.get(op_type) or GRADIENTS[op_type]
        return list(rule(payload, set(unneeded_indices), list(out_grads)))

    def ones_like(self, meta):
        self.calls["ones_like"] += 1
        shape, dtype = meta
        return T(np.ones(shape, dtype=dtype))

    def zeros_like(self, meta):
        self.calls["zeros_like"] += 1
        shape, dtype = meta
        return T(np.zeros(shape, dtype=dtype))

    def tensor_id(self, tensor):
        return tensor.id

    def forward_rule(self, op_type, payload, in_tangents, use_batch):
        self.calls["forward_rule"] += 1
        if self.on_forward is not None:
            self.on_forward(op_type, payload, in_tangents, use_batch)
        rule = FORWARD_RULES.get(op_type) if self.forward_rules else None
        if rule is None:
            self.calls["fallback"] += 1
            return NotImplemented
        self.calls["rule:" + op_type] += 1
        return rule(payload, list(in_tangents), use_batch)

    def unbatch(self, tangent):
        self.calls["unbatch"] += 1
        return [T(row) for row in tangent.value]

    def batch(self, tangents):
        self.calls["batch"] += 1
        return T(np.stack([t.value for t in tangents]))


# -- helpers ----------------------------------------------------------------

def gradient(tp, vspace, targets, sources, output_gradients=None,
             build_default_zeros=True):
    """tape.gradient: one result per source (None: unconnected). Like TF, a
    non-persistent tape stops recording first; ids that are both target and
    source go in sources_that_are_targets."""
    single = isinstance(sources, T)
    targets = [targets] if isinstance(targets, T) else list(targets)
    sources = [sources] if single else list(sources)
    target_ids = [t.id for t in targets]
    tset = set(target_ids)
    stt = {s.id: s.meta for s in sources if s.id in tset}
    if not tp.persistent and tp in TAPES:
        TAPES.remove(tp)
    if output_gradients is not None:
        output_gradients = [g if g is None or isinstance(g, T) else T(g)
                            for g in output_gradients]
    res = tp.compute_gradient(vspace, target_ids, [s.id for s in sources],
                              stt, output_gradients, build_default_zeros)
    return res[0] if single else res


def value(t):
    """NumPy value of a T; anything else (None, arrays) as is."""
    return t.value if isinstance(t, T) else t


class GradientMismatch(AssertionError):
    pass


def numerical_gradient(f, arrays, eps=1e-6):
    """Central differences of the scalar sum(f(*Ts)) w.r.t. each array, with
    nothing recording."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]

    def fval(arrs):
        with stop_recording():
            return float(np.sum(f(*[T(a) for a in arrs]).value))

    grads = []
    for i, a in enumerate(arrays):
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus = [x.copy() for x in arrays]
            minus = [x.copy() for x in arrays]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            g[idx] = (fval(plus) - fval(minus)) / (2 * eps)
        grads.append(g)
    return grads


def check_gradients(f, arrays, vspace=None, rtol=1e-5, atol=1e-6, eps=1e-6):
    """Tape gradients of sum(f(*xs)) against central differences; raises
    GradientMismatch on disagreement. Returns (analytic, numeric)."""
    vspace = vspace or NumpyVSpace()
    xs = [T(np.array(a, dtype=np.float64)) for a in arrays]
    with tape(watch=xs) as tp:
        y = f(*xs)
        if y.shape != ():
            y = reduce_sum(y)
    analytic = gradient(tp, vspace, y, xs)
    analytic = [np.zeros_like(x.value) if g is None else np.asarray(g.value)
                for g, x in zip(analytic, xs)]
    numeric = numerical_gradient(f, arrays, eps)
    for k, (a, n) in enumerate(zip(analytic, numeric)):
        if a.shape != n.shape or not np.allclose(a, n, rtol=rtol, atol=atol):
            raise GradientMismatch(
                f"gradient {k}: tape {a!r} vs numerical {n!r}")
    return analytic, numeric
