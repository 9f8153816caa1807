"""Random small differentiable programs, as data, for the differential fuzzer.

A ``Program`` is a straight-line list of values: inputs (constants, watched
or not, ``tf.Variable``s, int32 constants) and nodes (an op name, the
indices of its arguments, its parameters, and how it is wrapped: plainly, in
a ``tf.function`` or in a ``tf.custom_gradient``), plus a *mode* that says
what is differentiated and how (``gradient``, ``persistent``,
``second_order``, ``jacobian``, ``batch_jacobian``, ``jvp``,
``fwd_over_rev``, ``rev_over_fwd``), which values are targets and sources,
the output gradients (none, right, wrong shape, wrong dtype) and
``unconnected_gradients``. Being data, a program prints as readable
pseudo-code and hypothesis shrinks it.

``Runner(program)`` turns it into parity cases: ``runner.case(run)`` is a
``case(ForwardAccumulator, GradientTape)`` (see fd.py) whose input values
are drawn anew for each ``run`` (same shapes, so fasttape's compiled
backward is built and replayed), and ``runner.oracle(run)`` is the float64
central-difference answer for the same values (a nest like the case's, or
None where the program is invalid), computed by evaluating the program in
NumPy: stop_gradient and integer casts are constants there, and a source no
tape tracks (an unwatched constant, a non-trainable variable, an int, or a
value computed from those only) has no gradient: TF runs the gradient
functions of the recorded ops that read it (so a seed that does not fit
still raises) but returns None for it.
"""

import dataclasses
import functools
import math

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st

import fd

# -- the program description ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Input:
    kind: str            # "const" | "var" | "int"
    shape: tuple
    watched: bool = True  # const: tape.watch / a primal; var: trainable / a primal
    positive: bool = False


@dataclasses.dataclass(frozen=True)
class Node:
    op: str
    args: tuple          # indices of earlier values
    params: tuple = ()
    wrap: str = ""       # "" | "function" | "custom" | "custom_b_none" | FLOW_WRAPS


@dataclasses.dataclass(frozen=True)
class Program:
    dtype: str
    values: tuple        # Input | Node, in program order
    mode: str
    targets: tuple       # value indices
    sources: tuple       # value indices (gradient sources, or primals)
    seeds: str = "ones"  # "ones" | "right" | "wrong_shape:<how>" | "wrong_dtype:<dtype>"
    unconnected: str = "none"
    second_targets: tuple = ()   # persistent: the second gradient() call's targets
    pfor: bool = True    # jacobian / batch_jacobian: experimental_use_pfor
    seed: int = 0        # input values: rng([seed, run])
    context: str = "eager"   # "eager" | "function": the whole case in a tf.function
    budget: int = -1     # fasttape's memory_budget in bytes (-1: none; TF has none)

    def __repr__(self):
        lines = [f"Program({self.mode}, {self.dtype}, seed={self.seed}):"]
        for i, v in enumerate(self.values):
            if isinstance(v, Input):
                extra = []
                if v.kind == "const" and not v.watched:
                    extra.append("unwatched")
                if v.kind == "var" and not v.watched:
                    extra.append("trainable=False" if not _forward(self.mode)
                                 else "not a primal")
                if v.positive:
                    extra.append("positive")
                dtype = "int32" if v.kind == "int" else self.dtype
                lines.append(f"  v{i} = {v.kind} {dtype}{list(v.shape)}"
                             + (f"  ({', '.join(extra)})" if extra else ""))
            else:
                args = ", ".join(f"v{a}" for a in v.args)
                params = "".join(f", {p!r}" for p in v.params)
                wrap = f"  [{v.wrap}]" if v.wrap else ""
                lines.append(f"  v{i} = {v.op}({args}{params}){wrap}")
        targets = ", ".join(f"v{i}" for i in self.targets)
        sources = ", ".join(f"v{i}" for i in self.sources)
        line = f"  {self.mode}: targets [{targets}], sources [{sources}]"
        if self.seeds != "ones":
            line += f", output_gradients={self.seeds}"
        line += f", unconnected={self.unconnected}"
        if self.second_targets:
            line += ", then targets [" + ", ".join(
                f"v{i}" for i in self.second_targets) + "]"
        if self.mode in ("jacobian", "batch_jacobian"):
            line += f", pfor={self.pfor}"
        if self.context != "eager":
            line += f", in a {self.context}"
        if self.budget >= 0:
            line += f", memory_budget={self.budget}"
        lines.append(line)
        return "\n".join(lines)


FORWARD_MODES = ("jvp", "fwd_over_rev", "rev_over_fwd")
NESTED_MODES = ("second_order", "fwd_over_rev", "rev_over_fwd")


def _forward(mode):
    return mode in FORWARD_MODES


# -- ops: TF and NumPy side by side -----------------------------------------------

def _np_softplus(x):
    return np.logaddexp(0.0, x)


UNARY = {
    "sin": (tf.sin, np.sin),
    "cos": (tf.cos, np.cos),
    "exp": (tf.exp, np.exp),
    "tanh": (tf.tanh, np.tanh),
    "square": (tf.square, np.square),
    "sigmoid": (tf.sigmoid, lambda x: 1.0 / (1.0 + np.exp(-x))),
    "softplus": (tf.nn.softplus, _np_softplus),
    "neg": (tf.negative, np.negative),
    "abs": (tf.abs, np.abs),
    "relu": (tf.nn.relu, lambda x: np.maximum(x, 0.0)),
    "log": (tf.math.log, np.log),
    "sqrt": (tf.sqrt, np.sqrt),
    "identity": (tf.identity, lambda x: x),
}

BINARY = {
    "add": (tf.add, np.add),
    "sub": (tf.subtract, np.subtract),
    "mul": (tf.multiply, np.multiply),
    "div": (tf.math.divide, np.divide),
    "maximum": (tf.maximum, np.maximum),
    "minimum": (tf.minimum, np.minimum),
}

REDUCE = {
    "sum": (tf.reduce_sum, np.sum),
    "mean": (tf.reduce_mean, np.mean),
    "max": (tf.reduce_max, np.max),
    "min": (tf.reduce_min, np.min),
    "prod": (tf.reduce_prod, np.prod),
}

# Hand-written gradients for the custom_gradient wrap (x: input, y: output).
CUSTOM_UNARY_GRADS = {
    "sin": lambda x, y, dy: dy * tf.cos(x),
    "exp": lambda x, y, dy: dy * y,
    "tanh": lambda x, y, dy: dy * (1.0 - y * y),
    "square": lambda x, y, dy: dy * 2.0 * x,
    "sigmoid": lambda x, y, dy: dy * y * (1.0 - y),
}

# Values the derivative does not see (constants for the oracle).
FROZEN_OPS = ("stop_gradient", "cast_int")

# Wraps that run a node's op as it is (same value, same derivative) through
# another mechanism: control flow picking it (eager, or inside a
# tf.function: "fn_..."), tf.recompute_grad, tf.py_function.
FLOW_WRAPS = ("cond", "while", "switch", "fn_cond", "fn_while", "fn_switch",
              "recompute", "py_function")
# Wraps whose output a tape records as one op even around a frozen op (a
# function call, a recompute_grad's custom gradient, a py_function).
RECORDED_WRAPS = ("function", "fn_cond", "fn_while", "fn_switch", "recompute",
                  "py_function")


def _tf_slices(params):
    return tuple(slice(*p[1:]) if p[0] == "s" else p[1] for p in params)


def _matmul_np(args, p, dtype):
    a = np.swapaxes(args[0], -1, -2) if p[0] else args[0]
    b = np.swapaxes(args[1], -1, -2) if p[1] else args[1]
    return np.matmul(a, b)


def _reduce_tf(args, p, dtype):
    fn, axis, keepdims = p
    return REDUCE[fn][0](args[0], axis=list(axis) if isinstance(axis, tuple)
                         else axis, keepdims=keepdims)


def _reduce_np(args, p, dtype):
    fn, axis, keepdims = p
    return REDUCE[fn][1](args[0], axis=axis, keepdims=keepdims)


# op -> (TF implementation, NumPy implementation), each f(args, params, dtype)
OPS = {
    "reduce": (_reduce_tf, _reduce_np),
    "matmul": (lambda a, p, d: tf.matmul(a[0], a[1], transpose_a=p[0],
                                         transpose_b=p[1]), _matmul_np),
    "einsum": (lambda a, p, d: tf.einsum(p[0], *a),
               lambda a, p, d: np.einsum(p[0], *a)),
    "reshape": (lambda a, p, d: tf.reshape(a[0], p[0]),
                lambda a, p, d: np.reshape(a[0], p[0])),
    "transpose": (lambda a, p, d: tf.transpose(a[0], p[0]),
                  lambda a, p, d: np.transpose(a[0], p[0])),
    "slice": (lambda a, p, d: a[0][_tf_slices(p)],
              lambda a, p, d: a[0][_tf_slices(p)]),
    "gather": (lambda a, p, d: tf.gather(a[0], list(p[0]), axis=p[1]),
               lambda a, p, d: np.take(a[0], list(p[0]), axis=p[1])),
    "concat": (lambda a, p, d: tf.concat(list(a), axis=p[0]),
               lambda a, p, d: np.concatenate(a, axis=p[0])),
    "stack": (lambda a, p, d: tf.stack(list(a), axis=p[0]),
              lambda a, p, d: np.stack(a, axis=p[0])),
    "cast_int": (lambda a, p, d: tf.cast(tf.cast(a[0], tf.int32), d),
                 lambda a, p, d: np.trunc(a[0])),
    "stop_gradient": (lambda a, p, d: tf.stop_gradient(a[0]),
                      lambda a, p, d: a[0]),
    "to_float": (lambda a, p, d: tf.cast(a[0], d), lambda a, p, d: a[0]),
}
for _name, (_tf, _np) in UNARY.items():
    OPS[_name] = (lambda a, p, d, f=_tf: f(a[0]), lambda a, p, d, f=_np: f(a[0]))
for _name, (_tf, _np) in BINARY.items():
    OPS[_name] = (lambda a, p, d, f=_tf: f(a[0], a[1]),
                  lambda a, p, d, f=_np: f(a[0], a[1]))


def tf_apply(node, args, dtype):
    return OPS[node.op][0](args, node.params, dtype)


def np_apply(node, args):
    return np.asarray(OPS[node.op][1](args, node.params, None), dtype=np.float64)


def _shape_of(node, arg_shapes):
    return np.shape(np_apply(node, [np.ones(s) for s in arg_shapes]))


# -- generation -------------------------------------------------------------------

@dataclasses.dataclass
class _Meta:
    shape: tuple
    is_int: bool = False
    bound: float = 1.5    # max |element|
    lo: float = 0.0       # min |element| (0: unknown)
    pos: bool = False     # every element > 0
    is_var: bool = False  # the value is a tf.Variable


_MAX_BOUND = 1e3
_MAX_INPUTS = 5


class _Gen:
    def __init__(self, draw, mode):
        self.draw = draw
        self.mode = mode
        self.values = []
        self.meta = []

    def pick(self, options):
        return self.draw(st.sampled_from(options))

    def chance(self, p):
        """True with probability about p. Hypothesis favours draws of 0 (and
        shrinks toward them): 0 gives the likelier outcome, so a shrunk
        program keeps only the features its failure needs."""
        k = self.int(0, 99)
        return k < p * 100 if p >= 0.5 else k >= (1 - p) * 100

    def int(self, lo, hi):
        """An integer in [lo, hi], about uniformly (hypothesis' integers()
        favour small values strongly), shrinking toward lo."""
        return self.draw(st.sampled_from(range(lo, hi + 1)))

    def shape(self, min_rank=0, max_rank=3):
        rank = self.int(min_rank, max_rank)
        return tuple(self.int(1, 3) for _ in range(rank))

    def n_inputs(self):
        return sum(isinstance(v, Input) for v in self.values)

    def add(self, value, meta):
        self.values.append(value)
        self.meta.append(meta)
        return len(self.values) - 1

    def new_input(self, shape, kind=None, watched=None):
        if kind is None:
            kind = self.pick(["const", "const", "const", "var", "var", "int"])
        if watched is None:
            watched = self.chance(0.8)
        if kind == "int":
            i = self.add(Input("int", shape, watched), _Meta(shape, is_int=True,
                                                             bound=3.0))
            # ints enter the float program through a cast
            return self.add(Node("to_float", (i,)), _Meta(shape, bound=3.0))
        positive = self.chance(0.3)
        return self.add(Input(kind, shape, watched, positive),
                        _Meta(shape, bound=1.5, lo=0.5, pos=positive,
                              is_var=kind == "var"))

    def floats(self):
        return [i for i, m in enumerate(self.meta) if not m.is_int]

    def node(self, op, args, params=(), wrap="", **meta):
        n = Node(op, tuple(args), tuple(params), wrap)
        shape = _shape_of(n, [self.meta[a].shape for a in args])
        if meta.get("bound", 0.0) > _MAX_BOUND:
            return None
        return self.add(n, _Meta(shape, **meta))

    # each op builder returns the new value's index, or None if it cannot
    # be built from what there is (another op is then tried)

    def unary(self, a, wrap):
        m = self.meta[a]
        ops = list(UNARY)
        if not (m.pos and m.lo >= 0.05):
            ops = [o for o in ops if o not in ("log", "sqrt")]
        if m.bound > 3.0:
            ops.remove("exp")
        if wrap.startswith("custom"):
            ops = [o for o in ops if o in CUSTOM_UNARY_GRADS]
        op = self.pick(ops)
        b, lo = m.bound, m.lo
        meta = {
            "sin": dict(bound=1.0), "cos": dict(bound=1.0), "tanh": dict(bound=1.0),
            "exp": dict(bound=math.exp(min(b, 50)), lo=math.exp(-min(b, 50)),
                        pos=True),
            "square": dict(bound=b * b, lo=lo * lo, pos=lo > 0),
            "sigmoid": dict(bound=1.0, lo=1 / (1 + math.exp(min(b, 50))), pos=True),
            "softplus": dict(bound=b + 1, lo=math.log1p(math.exp(-min(b, 50))),
                             pos=True),
            "neg": dict(bound=b, lo=lo), "abs": dict(bound=b, lo=lo, pos=lo > 0),
            "relu": dict(bound=b),
            "log": dict(bound=max(abs(math.log(max(lo, 1e-9))), abs(math.log(b)))),
            "sqrt": dict(bound=math.sqrt(b), lo=math.sqrt(lo), pos=True),
            "identity": dict(bound=b, lo=lo, pos=m.pos),
        }[op]
        return self.node(op, [a], wrap=wrap, **meta)

    def partner(self, a, same_shape=False):
        """A second operand: a itself, an existing value or a new input, of
        a's shape or (mostly, broadcasting being where gradients go wrong)
        of another shape that broadcasts with a's."""
        sa = self.meta[a].shape
        same = [i for i in self.floats() if self.meta[i].shape == sa]
        if same_shape:
            ok = same
        else:
            ok = [i for i in self.floats() if self.meta[i].shape != sa
                  and _broadcastable(sa, self.meta[i].shape)]
            if not ok or self.chance(0.25):
                ok = same
        if self.n_inputs() < _MAX_INPUTS and self.chance(0.6):
            shape = sa if same_shape or self.chance(0.25) else self.broadcast_shape(sa)
            return self.new_input(shape)
        return self.pick(ok)

    def broadcast_shape(self, sa):
        """A shape other than sa (where there is one) that broadcasts with
        it: trailing dims of sa, some set to 1, or sa with a dim in front."""
        for _ in range(3):
            if self.chance(0.2) or not sa:
                shape = (self.int(1, 3),) + tuple(sa)
                if len(shape) > 4:
                    continue
            else:
                keep = self.int(0, len(sa))
                shape = tuple(1 if self.chance(0.4) else d
                              for d in sa[len(sa) - keep:])
            if shape != tuple(sa):
                return shape
        return tuple(sa)

    def binary(self, a, wrap):
        ops = list(BINARY)
        if wrap.startswith("custom"):
            ops = ["mul"]
        op = self.pick(ops)
        b = self.partner(a, same_shape=wrap.startswith("custom"))
        if self.chance(0.5):
            a, b = b, a
        ma, mb = self.meta[a], self.meta[b]
        if op == "div" and mb.lo < 0.05:
            a, b = b, a
            ma, mb = mb, ma
            if mb.lo < 0.05:
                op = "mul"
        meta = {
            "add": dict(bound=ma.bound + mb.bound,
                        lo=ma.lo + mb.lo if ma.pos and mb.pos else 0.0,
                        pos=ma.pos and mb.pos),
            "sub": dict(bound=ma.bound + mb.bound),
            "mul": dict(bound=ma.bound * mb.bound, lo=ma.lo * mb.lo,
                        pos=ma.pos and mb.pos),
            "div": dict(bound=ma.bound / max(mb.lo, 1e-9), lo=ma.lo / mb.bound,
                        pos=ma.pos and mb.pos),
            "maximum": dict(bound=max(ma.bound, mb.bound)),
            "minimum": dict(bound=max(ma.bound, mb.bound)),
        }[op]
        return self.node(op, [a, b], wrap=wrap, **meta)

    def reduce(self, a):
        m = self.meta[a]
        rank = len(m.shape)
        fn = self.pick(list(REDUCE))
        if rank == 0 or self.chance(0.3):
            axis = None
        elif self.chance(0.6):
            axis = self.int(-rank, rank - 1)
        else:
            axis = tuple(sorted(self.draw(st.sets(
                st.integers(0, rank - 1), min_size=1, max_size=rank))))
        keepdims = self.chance(0.4)
        size = int(np.prod(m.shape)) if m.shape else 1
        bound = {"sum": m.bound * size, "prod": m.bound ** size}.get(fn, m.bound)
        lo = {"sum": 0.0, "prod": m.lo ** size}.get(fn, m.lo) if m.pos else 0.0
        return self.node("reduce", [a], (fn, axis, keepdims), bound=bound,
                         lo=lo, pos=m.pos)

    def matmul(self, a):
        m = self.meta[a]
        if len(m.shape) == 1 and self.chance(0.5):
            b = self.partner(a, same_shape=True)
            bound = m.bound * self.meta[b].bound * m.shape[0]
            return self.node("einsum", [a, b], ("i,i->",), bound=bound)
        if len(m.shape) < 2:
            return None
        if self.chance(0.5):
            ta, tb = self.chance(0.3), self.chance(0.3)
            k = m.shape[-2] if ta else m.shape[-1]
            n = self.int(1, 3)
            want = (n, k) if tb else (k, n)
            if len(m.shape) == 3 and self.chance(0.5):
                want = (m.shape[0],) + want
            ok = [i for i in self.floats() if self.meta[i].shape == want]
            b = (self.pick(ok) if ok and self.chance(0.5) else
                 self.new_input(want) if self.n_inputs() < _MAX_INPUTS else None)
            if b is None:
                return None
            bound = m.bound * self.meta[b].bound * k
            return self.node("matmul", [a, b], (ta, tb), bound=bound)
        forms = {2: ["ij->ji", "ij->j", "ij,jk->ik", "ij,ij->i", "ij,kj->ik"],
                 3: ["bij->bji", "bij->bj", "bij,bjk->bik", "bij,bij->bj"]
                 }.get(len(m.shape))
        if forms is None:
            return None
        eq = self.pick(forms)
        args = [a]
        bound = m.bound * int(np.prod(m.shape))
        if "," in eq:
            lhs = eq.split("->")[0].split(",")
            dims = dict(zip(lhs[0], m.shape))
            want = tuple(dims.get(c) or self.int(1, 3) for c in lhs[1])
            ok = [i for i in self.floats() if self.meta[i].shape == want]
            b = (self.pick(ok) if ok and self.chance(0.5) else
                 self.new_input(want) if self.n_inputs() < _MAX_INPUTS else None)
            if b is None:
                return None
            args.append(b)
            bound *= self.meta[b].bound
        return self.node("einsum", args, (eq,), bound=bound)

    def reshape(self, a):
        m = self.meta[a]
        size = int(np.prod(m.shape)) if m.shape else 1
        shapes = [s for s in _shapes_with_size(size) if s != m.shape] or [m.shape]
        shape = self.pick(shapes)
        if shape and self.chance(0.3):
            k = self.int(0, len(shape) - 1)
            shape = shape[:k] + (-1,) + shape[k + 1:]
        return self.node("reshape", [a], (shape,), bound=m.bound, lo=m.lo,
                         pos=m.pos)

    def transpose(self, a):
        m = self.meta[a]
        if len(m.shape) < 2:
            return None
        perm = tuple(self.draw(st.permutations(range(len(m.shape)))))
        return self.node("transpose", [a], (perm,), bound=m.bound, lo=m.lo,
                         pos=m.pos)

    def slice(self, a):
        m = self.meta[a]
        if not m.shape:
            return None
        params = []
        for d in m.shape[:self.int(1, len(m.shape))]:
            if self.chance(0.25):
                params.append(("i", self.int(-d, d - 1)))
            else:
                start = self.int(0, d - 1)
                stop = self.int(start + 1, d)
                params.append(("s", start, stop, self.pick([1, 1, 2])))
        return self.node("slice", [a], tuple(params), bound=m.bound, lo=m.lo,
                         pos=m.pos)

    def gather(self, a):
        m = self.meta[a]
        if not m.shape:
            return None
        if m.is_var and _forward(self.mode):
            return None    # TF cannot transpose a ResourceGather (README)
        axis = 0 if m.is_var or self.chance(0.6) else self.int(0, len(m.shape) - 1)
        d = m.shape[axis]
        idx = tuple(self.draw(st.lists(st.integers(0, d - 1), min_size=1,
                                       max_size=4)))
        return self.node("gather", [a], (idx, axis), bound=m.bound, lo=m.lo,
                         pos=m.pos)

    def join(self, a):
        m = self.meta[a]
        b = self.partner(a, same_shape=True)
        if self.chance(0.5):
            if not m.shape:
                return None
            axis = self.int(0, len(m.shape) - 1)
            op = "concat"
        else:
            axis = self.int(0, len(m.shape))
            op = "stack"
        mb = self.meta[b]
        return self.node(op, [a, b], (axis,), bound=max(m.bound, mb.bound),
                         lo=min(m.lo, mb.lo), pos=m.pos and mb.pos)

    def frozen(self, a):
        m = self.meta[a]
        op = self.pick(FROZEN_OPS)
        return self.node(op, [a], bound=m.bound, lo=m.lo if op ==
                         "stop_gradient" else 0.0, pos=m.pos and op == "stop_gradient")


def _broadcastable(a, b):
    try:
        np.broadcast_shapes(a, b)
        return True
    except ValueError:
        return False


@functools.lru_cache(maxsize=None)
def _shapes_with_size(n, max_rank=3):
    """Every shape of rank <= max_rank with n elements."""
    out = [()] if n == 1 else []
    if max_rank == 0:
        return out
    for d in range(1, n + 1):
        if n % d == 0:
            out += [(d,) + rest for rest in _shapes_with_size(n // d, max_rank - 1)]
    return sorted(set(out), key=lambda s: (len(s), s))


_MODES = (["gradient"] * 7 + ["persistent"] * 2 + ["second_order"] * 2
          + ["jacobian"] * 2 + ["batch_jacobian"] + ["jvp"] * 3
          + ["fwd_over_rev"] * 2 + ["rev_over_fwd"])

_OPS = (["unary"] * 6 + ["binary"] * 6 + ["reduce"] * 2 + ["matmul"] * 2
        + ["reshape", "transpose", "slice", "gather", "join", "frozen"])


@st.composite
def programs(draw, max_ops=7, flow=False):
    """A random Program. ``flow``: also control flow, tf.recompute_grad and
    tf.py_function around nodes (FLOW_WRAPS), the whole case in a
    tf.function, and fasttape's memory_budget (drawn after everything
    else, so flow=False draws the programs it always drew)."""
    mode = draw(st.sampled_from(_MODES))
    dtype = draw(st.sampled_from(["float32", "float32", "float64"]))
    g = _Gen(draw, mode)
    # The first input is a float that every mode can differentiate.
    g.new_input(g.shape(min_rank=2 if mode == "batch_jacobian" else 0),
                kind=g.pick(["const", "const", "var"]), watched=True)
    if g.chance(0.4):
        g.new_input(g.shape(), kind=None if mode not in NESTED_MODES else g.pick(
            ["const", "var"]))
    n_ops = g.int(2, max_ops)
    for _ in range(n_ops):
        nodes = [i for i, v in enumerate(g.values)
                 if isinstance(v, Node) and not g.meta[i].is_int]
        floats = g.floats()
        # mostly build on the newest value, so programs are deep, not wide
        a = nodes[-1] if nodes and g.chance(0.6) else g.pick(floats)
        wrap = ""
        if g.chance(0.12) and mode != "rev_over_fwd":
            wrap = "function"
        elif g.chance(0.08):
            wrap = "custom_b_none" if (
                g.chance(0.3) and mode not in NESTED_MODES) else "custom"
        kind = g.draw(st.sampled_from(_OPS))
        if wrap.startswith("custom"):
            kind = "binary" if wrap == "custom_b_none" else g.pick(
                ["unary", "binary"])
        built = None
        if kind == "unary":
            built = g.unary(a, wrap)
        elif kind == "binary":
            built = g.binary(a, wrap)
        elif not wrap.startswith("custom"):
            built = getattr(g, kind)(a)
            if built is not None and wrap:
                n = g.values[built]
                g.values[built] = dataclasses.replace(n, wrap=wrap)
        if built is None:
            g.unary(a, "")

    if flow:
        _add_flow(g)
    values = tuple(g.values)
    floats = g.floats()
    nodes = [i for i in floats if isinstance(values[i], Node)]
    last = nodes[-1] if nodes else floats[-1]
    inputs = [i for i, v in enumerate(values) if isinstance(v, Input)]
    watched = [i for i in inputs if values[i].kind != "int" and values[i].watched]
    pfor = draw(st.booleans())
    seeds, unconnected, second = "ones", g.pick(["none", "none", "zero"]), ()
    targets = (last,)

    if mode == "batch_jacobian":
        b = g.meta[0].shape[0]
        ok = [i for i in nodes if len(g.meta[i].shape) >= 2
              and g.meta[i].shape[0] == b]
        if ok:
            targets, sources = (ok[-1] if last not in ok else last,), (0,)
        else:
            mode = "jacobian"
    if mode in ("gradient", "persistent", "jacobian"):
        pool = [i for i in inputs if mode != "jacobian" or values[i].kind != "int"]
        sources = tuple(draw(st.lists(st.sampled_from(pool), min_size=1,
                                      max_size=3, unique=True)))
        if g.chance(0.2):      # an intermediate value (or a target) as a source
            sources += (g.pick(nodes or floats),)
        if mode != "jacobian" and g.chance(0.3):
            other = g.pick(floats)
            if other not in targets:
                targets += (other,)
        if mode == "persistent":
            second = (g.pick(floats),)
        if mode != "jacobian":
            seeds = g.pick(["ones"] * 10 + ["right"] * 5 + [
                "wrong_shape:prepend", "wrong_shape:grow", "wrong_shape:scalar",
                "wrong_dtype:other", "wrong_dtype:int32"])
    elif mode in FORWARD_MODES or mode == "second_order":
        sources = tuple(watched)
    prog = Program(dtype=dtype, values=values, mode=mode, targets=targets,
                   sources=sources, seeds=seeds, unconnected=unconnected,
                   second_targets=second, pfor=pfor,
                   seed=g.int(0, 2 ** 16))
    if flow:
        prog = dataclasses.replace(
            prog, context=g.pick(["eager", "eager", "function"]),
            budget=g.pick([-1, -1, 0, 64, 4096]))
        if prog.context == "function":
            # a tf.py_function traced into the case's function: TF loses
            # its Python callable between calls (UnknownError, KeyError
            # b'pyfunc_N'), whichever tape runs
            prog = dataclasses.replace(prog, values=tuple(
                dataclasses.replace(v, wrap="") if isinstance(v, Node)
                and v.wrap == "py_function" else v for v in prog.values))
    return prog


def _add_flow(g):
    """Rewrap some plain nodes (each with probability about 0.4) in one of
    FLOW_WRAPS. Not control flow in a tf.function under an accumulator
    in reverse-over-forward, or with a Variable primal: TF's known fault (a Variable into a tf.function,
    README) then raises in TF's own gradient of the If / Case / While, which
    the accumulator transposes (TypeError, AttributeError, ValueError)."""
    wraps = FLOW_WRAPS
    if g.mode == "rev_over_fwd" or (_forward(g.mode) and any(m.is_var for m in g.meta)):
        # nor a tf.function in reverse-over-forward (as programs() draws
        # none): TF's known fault (README), InternalError "too few gradients"
        wraps = tuple(w for w in wraps if not w.startswith("fn_"))
    if _forward(g.mode):
        # TF's recompute_grad refuses forward mode (NotImplementedError), and
        # a tf.py_function's gradient runs once (a second run, transposing
        # it, raises UnknownError: KeyError in its tape cache), either of
        # which a fault of TF's elsewhere in the program may preempt
        wraps = tuple(w for w in wraps if w not in ("recompute", "py_function"))
    for i, v in enumerate(g.values):
        if isinstance(v, Node) and not v.wrap and v.op != "to_float" and g.chance(0.4):
            g.values[i] = dataclasses.replace(v, wrap=g.pick(wraps))


# -- running ----------------------------------------------------------------------

_UNCONNECTED = {"none": tf.UnconnectedGradients.NONE,
                "zero": tf.UnconnectedGradients.ZERO}


def _wrong_shape(shape, how):
    if how == "prepend" or (how == "scalar" and shape == ()):
        return (1,) + tuple(shape)
    if how == "scalar":
        return ()
    if not shape:
        return (2,)
    return tuple(shape[:-1]) + (shape[-1] + 1,)


class Runner:
    """Cases and oracles for one program; keeps its tf.functions per
    implementation, so later runs reuse their traces."""

    def __init__(self, program):
        self.p = program
        self._functions = {}
        self._shapes = None
        # Control flow in a kept tf.function captures the Variables of its
        # first call (TF then raises "Called a function referencing
        # variables which have been deleted"): such programs keep their
        # Variables too, and later runs assign them new values, as a
        # training loop does.
        self._keep_variables = any(isinstance(v, Node) and v.wrap.startswith("fn_")
                                   for v in program.values)
        self._variables = {}

    # values

    def shapes(self):
        if self._shapes is None:
            shapes = []
            for v in self.p.values:
                shapes.append(v.shape if isinstance(v, Input) else _shape_of(
                    v, [shapes[a] for a in v.args]))
            self._shapes = shapes
        return self._shapes

    def data(self, run):
        """Input values, seeds and tangents of one run, as float64 arrays
        exactly representable in the program's dtype."""
        p = self.p
        rng = np.random.default_rng([p.seed, run])
        np_dtype = np.dtype(p.dtype)
        inputs = {}
        for i, v in enumerate(p.values):
            if not isinstance(v, Input):
                continue
            if v.kind == "int":
                inputs[i] = rng.integers(-3, 4, size=v.shape).astype(np.int32)
                continue
            mag = rng.uniform(0.5, 1.5, size=v.shape)
            sign = 1.0 if v.positive else rng.choice([-1.0, 1.0], size=v.shape)
            inputs[i] = (mag * sign).astype(np_dtype).astype(np.float64)
        shapes = self.shapes()
        seeds = [rng.uniform(-1, 1, size=shapes[t]).astype(np_dtype).astype(
            np.float64) for t in p.targets]
        tangents = [rng.uniform(-1, 1, size=shapes[s]).astype(np_dtype).astype(
            np.float64) for s in p.sources]
        return inputs, seeds, tangents

    def _output_gradients(self, seeds):
        p = self.p
        kind = p.seeds
        if kind == "ones":
            return None
        if kind == "right":
            return [tf.constant(s, dtype=p.dtype) for s in seeds]
        if kind.startswith("wrong_shape"):
            how = kind.split(":")[1]
            return [tf.ones(_wrong_shape(np.shape(s), how), dtype=p.dtype)
                    for s in seeds]
        other = {"float32": "float64", "float64": "float32"}[p.dtype]
        dtype = other if kind.endswith("other") else "int32"
        return [tf.ones(np.shape(s), dtype=dtype) for s in seeds]

    def forward(self, tensors, impl):
        p = self.p
        vals = list(tensors)
        for i, v in enumerate(p.values):
            if isinstance(v, Input):
                continue
            args = [vals[a] for a in v.args]
            if v.wrap in ("function", "fn_cond", "fn_while", "fn_switch",
                          "recompute"):
                fn = self._functions.get((impl, i))
                if fn is None:
                    fn = (tf.recompute_grad(_flow(v, p.dtype)) if v.wrap == "recompute"
                          else tf.function(_flow(v, p.dtype), autograph=False))
                    self._functions[(impl, i)] = fn
                vals[i] = fn(*args)
            elif v.wrap in FLOW_WRAPS:
                vals[i] = _flow(v, p.dtype)(*args)
            elif v.wrap.startswith("custom"):
                vals[i] = _custom(v, p.dtype)(*[tf.convert_to_tensor(a) for a in args])
            else:
                vals[i] = tf_apply(v, args, p.dtype)
        return vals

    def case(self, run):
        p = self.p
        inputs, seeds, tangents = self.data(run)

        def case(FA, GT):
            impl = "tf" if GT is tf.GradientTape else "fasttape"
            forward_mode = _forward(p.mode)
            tensors = [None] * len(p.values)
            for i, x in inputs.items():
                v = p.values[i]
                if v.kind == "int":
                    tensors[i] = tf.constant(x)
                elif v.kind == "var" and (impl, i) in self._variables:
                    tensors[i] = self._variables[(impl, i)]
                    tensors[i].assign(x.astype(p.dtype))
                elif v.kind == "var":
                    tensors[i] = tf.Variable(x.astype(p.dtype), trainable=(
                        v.watched or forward_mode))
                    if self._keep_variables:
                        self._variables[(impl, i)] = tensors[i]
                else:
                    tensors[i] = tf.constant(x, dtype=p.dtype)
            if p.budget >= 0 and impl == "fasttape":
                GT = functools.partial(GT, memory_budget=p.budget)
            if p.context == "function":
                # the inputs are the function's arguments (placeholders);
                # later runs call the same function (its trace, new values)
                fn = self._functions.get((impl, "case"))
                if fn is None:
                    fn = tf.function(lambda ts, og, tans: differentiate(
                        FA, GT, impl, list(ts), og, tans), autograph=False)
                    self._functions[(impl, "case")] = fn
                # seeds and tangents too: constants would keep run 0's
                return fn(tensors, self._output_gradients(seeds),
                          [tf.constant(x, dtype=p.dtype) for x in tangents])
            return differentiate(FA, GT, impl, tensors,
                                 self._output_gradients(seeds),
                                 [tf.constant(x, dtype=p.dtype) for x in tangents])

        def differentiate(FA, GT, impl, tensors, output_gradients, tans):
            watch = [tensors[i] for i, v in enumerate(p.values)
                     if isinstance(v, Input) and v.kind != "var" and v.watched]
            unconnected = _UNCONNECTED[p.unconnected]
            zero = tf.UnconnectedGradients.ZERO
            mode = p.mode

            def src(vals):
                return [vals[s] for s in p.sources]

            if mode in ("gradient", "persistent"):
                with GT(persistent=mode == "persistent") as t:
                    for x in watch:
                        t.watch(x)
                    vals = self.forward(tensors, impl)
                result = [t.gradient([vals[i] for i in p.targets], src(vals),
                                     output_gradients=output_gradients,
                                     unconnected_gradients=unconnected)]
                if mode == "persistent":
                    result.append(t.gradient([vals[i] for i in p.second_targets],
                                             src(vals),
                                             unconnected_gradients=unconnected))
                return result
            if mode in ("jacobian", "batch_jacobian"):
                # eager while-loop jacobians need a persistent tape
                with GT(persistent=not p.pfor) as t:
                    for x in watch:
                        t.watch(x)
                    vals = self.forward(tensors, impl)
                if mode == "jacobian":
                    return t.jacobian(vals[p.targets[0]], src(vals),
                                      unconnected_gradients=unconnected,
                                      experimental_use_pfor=p.pfor)
                return t.batch_jacobian(vals[p.targets[0]], vals[p.sources[0]],
                                        unconnected_gradients=unconnected,
                                        experimental_use_pfor=p.pfor)
            if mode == "second_order":
                with GT() as outer:
                    for x in watch:
                        outer.watch(x)
                    with GT() as inner:
                        for x in watch:
                            inner.watch(x)
                        vals = self.forward(tensors, impl)
                    g = inner.gradient([vals[i] for i in p.targets], src(vals),
                                       unconnected_gradients=zero)
                    g = [tf.convert_to_tensor(x) for x in g]
                return [g, outer.gradient(g, src(tensors),
                                          unconnected_gradients=unconnected)]
            primals = src(tensors)
            if mode == "jvp":
                with FA(primals, tans) as acc:
                    vals = self.forward(tensors, impl)
                return [acc.jvp([vals[i] for i in p.targets],
                                unconnected_gradients=unconnected)]
            if mode == "fwd_over_rev":
                with FA(primals, tans) as acc:
                    with GT() as t:
                        for x in watch:
                            t.watch(x)
                        vals = self.forward(tensors, impl)
                    g = t.gradient([vals[i] for i in p.targets], primals,
                                   unconnected_gradients=zero)
                    g = [tf.convert_to_tensor(x) for x in g]
                return [g, acc.jvp(g, unconnected_gradients=unconnected)]
            if mode == "rev_over_fwd":
                with GT() as t:
                    for x in watch:
                        t.watch(x)
                    with FA(primals, tans) as acc:
                        vals = self.forward(tensors, impl)
                        j = acc.jvp([vals[i] for i in p.targets],
                                    unconnected_gradients=zero)
                return [j, t.gradient(j, primals, unconnected_gradients=unconnected)]
            raise ValueError(mode)

        return case

    # the oracle

    def tracked(self):
        """Which values a tape (gradient modes) or the accumulator (forward
        modes) tracks: its watched inputs, and every op reading one."""
        p = self.p
        out = []
        for i, v in enumerate(p.values):
            if isinstance(v, Input):
                if _forward(p.mode):
                    out.append(i in p.sources)
                else:
                    out.append(v.kind != "int" and v.watched)
            else:
                # TF records neither StopGradient (no gradient) nor the
                # int->float cast (an int input is never watched); a
                # tf.function around them is recorded (its output tracked,
                # its gradient zero)
                out.append((v.op not in FROZEN_OPS or v.wrap in RECORDED_WRAPS)
                           and any(out[a] for a in v.args))
        return out

    def ancestors(self, targets):
        """The values the targets are computed from, targets included."""
        seen, stack = set(), list(targets)
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                if isinstance(self.p.values[i], Node):
                    stack.extend(self.p.values[i].args)
        return seen

    def _untracked_source_is_own_target(self, s, targets, tracked):
        """An untracked source gets no gradient, except as a target itself
        when no recorded op on the way to the targets reads it (then its
        seed comes back as it is; TF's tape.h, measured)."""
        if s not in targets:
            return False
        v = self.p.values[s]
        if isinstance(v, Input) and v.kind == "var":
            return True     # ops read its value, never its handle (the source)
        up = self.ancestors(targets)
        return not any(isinstance(v, Node) and tracked[i] and s in v.args
                       for i, v in enumerate(self.p.values) if i in up)

    def oracle(self, run):
        """The float64 finite-difference answer, a nest shaped like the
        case's result (None: the program is invalid, or its inputs sit on a
        tie of a maximum / minimum, where finite differences mislead)."""
        p = self.p
        if p.seeds.startswith("wrong"):
            return None
        inputs, seeds, tangents = self.data(run)
        ev = _Evaluator(p, inputs, self.tracked())
        path = self.ancestors(p.targets + p.second_targets)
        if ev.on_a_kink([i for i in path if ev.tracked[i]]):
            return None
        shapes = self.shapes()
        mode = p.mode

        def grad(targets, cotangents, at=None, eps=1e-6):
            """Gradient of sum(cotangent * target) per source (at: overrides)."""
            out = []
            for s in p.sources:
                if not ev.tracked[s]:
                    own = self._untracked_source_is_own_target(s, targets, ev.tracked)
                    out.append(sum((np.ones(shapes[s]) if ct is None else ct)
                                   for t, ct in zip(targets, cotangents) if t == s)
                               if own else np.zeros(shapes[s]))
                    continue
                x0 = (at or {}).get(s, ev.base[s])
                total = np.zeros(shapes[s])
                for t, ct in zip(targets, cotangents):
                    f = (lambda x, _s=s, _t=t: ev.value(_t, {**(at or {}), _s: x}))
                    (j,) = fd.central_difference(f, [x0], eps)
                    rank = j.ndim - len(shapes[s])
                    total = total + np.tensordot(
                        np.ones(j.shape[:rank]) if ct is None else ct, j, axes=rank)
                out.append(total)
            return out

        def jvp(targets, at=None, eps=1e-6):
            at = at or {}
            plus = {s: at.get(s, ev.base[s]) + eps * t for s, t in zip(p.sources, tangents)}
            minus = {s: at.get(s, ev.base[s]) - eps * t for s, t in zip(p.sources, tangents)}
            return [(ev.value(t, {**at, **plus}) - ev.value(t, {**at, **minus}))
                    / (2 * eps) for t in targets]

        ones = [None] * len(p.targets)
        if mode in ("gradient", "persistent"):
            cts = seeds if p.seeds == "right" else ones
            result = [grad(p.targets, cts)]
            if mode == "persistent":
                result.append(grad(p.second_targets, [None]))
            return result
        if mode in ("jacobian", "batch_jacobian"):
            t = p.targets[0]
            jacs = []
            for s in p.sources:
                if not ev.tracked[s]:
                    n = int(np.prod(shapes[s]))
                    own = self._untracked_source_is_own_target(s, (t,), ev.tracked)
                    jacs.append(np.eye(n).reshape(shapes[t] + shapes[s]) if own
                                else np.zeros(shapes[t] + shapes[s]))
                    continue
                (j,) = fd.central_difference(
                    lambda x, _s=s: ev.value(t, {_s: x}), [ev.base[s]])
                jacs.append(j)
            if mode == "jacobian":
                return jacs
            # row j of batch_jacobian is the gradient of sum_i y[i, j]: the
            # diagonal blocks where rows do not depend on each other
            j = jacs[0]
            ry = len(shapes[t])
            return np.moveaxis(j.sum(axis=0), ry - 1, 0)
        inner_eps, outer_eps = 1e-5, 1e-4
        if mode == "second_order":
            def total(at):
                return sum(np.sum(g) for g in grad(p.targets, ones, at, inner_eps))
            h = []
            for s in p.sources:
                (j,) = fd.central_difference(
                    lambda x, _s=s: total({_s: x}), [ev.base[s]], outer_eps)
                h.append(j)
            return [grad(p.targets, ones), h]
        if mode == "jvp":
            return [jvp(p.targets)]
        if mode == "fwd_over_rev":
            plus = {s: ev.base[s] + outer_eps * t for s, t in zip(p.sources, tangents)}
            minus = {s: ev.base[s] - outer_eps * t for s, t in zip(p.sources, tangents)}
            gp = grad(p.targets, ones, plus, inner_eps)
            gm = grad(p.targets, ones, minus, inner_eps)
            return [grad(p.targets, ones),
                    [(a - b) / (2 * outer_eps) for a, b in zip(gp, gm)]]
        if mode == "rev_over_fwd":
            def total(at):
                return sum(np.sum(j) for j in jvp(p.targets, at, inner_eps))
            g = []
            for s in p.sources:
                (j,) = fd.central_difference(
                    lambda x, _s=s: total({_s: x}), [ev.base[s]], outer_eps)
                g.append(j)
            return [jvp(p.targets), g]
        raise ValueError(mode)

    def tolerance(self):
        """(rtol, atol) for judging against the oracle."""
        if self.p.dtype == "float32":
            return 2e-3, 2e-3
        if self.p.mode in NESTED_MODES:
            return 1e-4, 1e-4
        return 1e-5, 1e-6


def _flow(node, dtype):
    """node's op as a function of its arguments, through its wrap's
    mechanism (the tf.function, if any, is the caller's): a tf.cond, a
    tf.switch_case whose predicate / index depends on the data but always
    picks the op; a tf.while_loop that runs it once; a tf.py_function."""
    kind = node.wrap[3:] if node.wrap.startswith("fn_") else node.wrap

    def op(*args):
        return tf_apply(node, args, dtype)

    def other(*args):
        return 2.0 * op(*args)

    if kind == "cond":
        def f(*args):
            x = tf.convert_to_tensor(args[0])
            taken = tf.reduce_all(tf.math.is_finite(x))   # True, from the data
            return tf.cond(taken, lambda: op(*args), lambda: other(*args))
        return f
    if kind == "switch":
        def f(*args):
            x = tf.convert_to_tensor(args[0])
            index = tf.cast(tf.reduce_all(tf.math.is_finite(x)), tf.int32)   # 1
            return tf.switch_case(index, [lambda: other(*args), lambda: op(*args),
                                          lambda: other(*args)])
        return f
    if kind == "while":
        def f(*args):
            y0 = tf.zeros_like(op(*[tf.stop_gradient(a) for a in args]))
            _, y = tf.while_loop(lambda i, y: i < 1,
                                 lambda i, y: (i + 1, op(*args)),
                                 [tf.constant(0), y0])
            return y
        return f
    if kind == "py_function":
        def f(*args):
            y = tf.py_function(op, list(args), Tout=dtype)
            shapes = [tf.convert_to_tensor(a).shape for a in args]
            y.set_shape(_shape_of(node, [tuple(s) for s in shapes]))
            return y
        return f
    return op    # function, recompute: the op itself


def _tie(node, args):
    """Does a maximum / minimum (elementwise or reduced) compare equal
    values here? There central differences split the derivative where TF
    gives it to one side: no oracle."""
    if node.op in ("maximum", "minimum"):
        a, b = np.broadcast_arrays(*args)
        return bool(np.any(a == b))
    if node.op == "reduce" and node.params[0] in ("max", "min"):
        x, axis = args[0], node.params[1]
        pick = np.max if node.params[0] == "max" else np.min
        best = pick(x, axis=axis, keepdims=True)
        return bool(np.any(np.sum(x == best, axis=axis) > 1))
    return False


def _custom(node, dtype):
    """node's op under tf.custom_gradient, with a hand-written gradient
    (custom_b_none: None for the second argument)."""
    op = node.op

    @tf.custom_gradient
    def f(*args):
        y = tf_apply(node, args, dtype)

        def grad(dy):
            if op in CUSTOM_UNARY_GRADS:
                return CUSTOM_UNARY_GRADS[op](args[0], y, dy)
            a, b = args            # mul, same shapes
            return dy * b, (None if node.wrap == "custom_b_none" else dy * a)
        return y, grad
    return f


class _Evaluator:
    """The program in float64 NumPy. ``value(i, overrides)`` recomputes value
    i with some values replaced; stop_gradient, integer casts and (in
    reverse mode) a custom gradient's None input keep their unperturbed
    values (constants). Forward mode differentiates through the latter: the
    tangent of ``a * b`` under a custom gradient with None for b still
    carries b's (TF and fasttape alike)."""

    def __init__(self, program, inputs, tracked):
        self.p = program
        self.inputs = inputs
        self.tracked = tracked
        self.base = self._eval({}, base=True)

    def on_a_kink(self, nodes):
        """Does one of these (differentiated) nodes sit on a tie here?"""
        return any(_tie(self.p.values[i], [self.base[a] for a in self.p.values[i].args])
                   for i in nodes if isinstance(self.p.values[i], Node))

    def _eval(self, overrides, base=False):
        vals = []
        for i, v in enumerate(self.p.values):
            if i in overrides:
                vals.append(np.asarray(overrides[i], dtype=np.float64))
            elif isinstance(v, Input):
                vals.append(np.asarray(self.inputs[i], dtype=np.float64))
            elif not base and v.op in FROZEN_OPS:
                vals.append(self.base[i])
            else:
                args = []
                for k, a in enumerate(v.args):
                    frozen = (v.wrap == "custom_b_none" and k == 1
                              and not _forward(self.p.mode))
                    args.append(self.base[a] if frozen and not base else vals[a])
                vals.append(np_apply(v, args))
        return vals

    def value(self, i, overrides):
        return self._eval(overrides)[i]
