"""Compiled backward passes: a repeated tape shape replays one graph function.

Training loops record the same program step after step. The core's
``plan`` gives the shape of a backward pass (which ops, how they connect)
and ``backward_signature`` the rest of what it depends on besides tensor
values (op types, attrs, dtypes and shapes of the tensors each gradient
reads). Together they key a cache. When a key has been seen often enough
that compiling it should pay (``auto``: see "When a pass is built" below),
the pass is traced once into a graph function by running the core's own
backward loop over symbolic stand-ins of the saved tensors, with TF's
registered gradient functions; from then on the whole backward pass is one
function call instead of hundreds of eager dispatches.

When a pass is built (``auto``). Building costs far more than running the
pass eagerly (tracing plus TF's instantiation: about 0.4 to 1 ms per
backward op here, 10-20x TF's whole backward of a 400-op chain), and
``TFE_ContextClearCaches`` (``tf.random.set_seed``,
``keras.utils.set_random_seed``, ``clear_kernel_cache``) drops the
instantiated kernels of every traced function, so a cached pass pays
instantiation again on its next call. So the cache weighs costs, per key
(``_Cache.worth_building``): a key seen once is never built; from its
second use it is built only if ``saving * uses ahead >= build cost``.
``saving`` is the fastest eager pass measured for the key times the share a
compiled pass saves (``1 - _COMPILED_SHARE``), at most ``_SAVING_PER_ENTRY``
per backward op (the dispatch compiling saves), less the re-instantiation
expected per use (kernel-cache clears since the key was first seen, per
use of it, at most one). ``uses ahead`` is, for a steady key (its last three
gaps equal: a loop over one shape, or a few in turn), its
uses per gradient call times ``HORIZON`` calls (or its age, if longer),
and for any other key as many uses again as it has had (ski rental: an
irregular key is built once what compiling would have saved reaches the
build cost). The build cost is estimated per backward op from the builds
measured in this process. So a fixed-shape loop builds at its fourth
step, while a sequence length drawn every step, or a shape used once per
re-seed, stays eager until it has paid for itself. While keys churn (16
calls in a row neither replayed nor built a pass), the key is computed on
one call in four only: computing it (the backward signature) is then the
one cost of the cache, and a quarter of it. A built pass whose kernels were dropped is called again
(``worth_instantiating``) only where the uses expected before the next
clear pay for its re-instantiation; else that step runs eagerly.

Nothing silently wrong: a pass is compiled only when every op was run
eagerly (no custom_gradient or tf.function payloads, whose Python closures
hold per-step state), the trace captures no eager tensor, and, on the step
it is built, the compiled result matches the eager one (which is returned
that step); a key that fails any of these is never compiled again. A pass
whose compiled call is no faster than the eager pass (small passes, where a
function call costs more than a few fast-path kernels) stays eager too. The
eager pass is used whenever anything would record the backward pass
(higher-order gradients), while profiling (per-op-type entries), outside
eager mode, and on more than one device.

Never worse than TF's eager tape. A build is something the user never
asked for, so nothing about it may fail where the eager pass would not:
- A pass of more than ``_MAX_BUILT_ENTRIES`` backward ops is never built
  in ``auto`` mode: tracing holds about 40 KB per op while it runs, which
  over hundreds of thousands of ops is more memory than the machine has.
- A pass whose graph holds constant-foldable tensors of more than
  ``_MAX_FOLDED_BYTES`` in all (a zeros gradient of a large unused output, a
  ones seed of a large target) is not compiled. TF's function instantiation
  constant-folds them (``GraphRunner`` evaluates every foldable node whatever
  its size, then keeps only constants of up to 10 MB), and the options that
  switch it off are fixed when the eager context is made (the call's
  ``config_proto`` does not reach them). Under memory pressure its copy of
  an output into a failed allocation kills the process; without it, the
  folded constants would be held by the cached function.
- In a forked child (``os.register_at_fork``) no pass is built or called:
  any ``tf.function`` call hangs in a forked TensorFlow child, and TF's eager
  tape calls none.
- An exception while a pass is built or first called (tracing, a kernel
  error, ``ResourceExhaustedError``) leaves the step to the eager pass, which
  raises what TF's tape raises, or succeeds. A KeyboardInterrupt is the
  user's and propagates (the tape is left as an interrupted eager pass
  leaves it).

What a leak check sees. A built pass is a traced function registered in
TF's context (named ``__inference_backward_N``), held by this cache (at most
``_MAX_ENTRIES``) until ``fasttape.clear_caches()`` or
``context.context()._clear_caches()``, which release it (and so
``test_util.assert_no_new_tensors``, which calls the latter, sees none).
A check that compares ``context.context().list_function_names()`` or counts
Python objects before and after a window, without clearing caches, sees a
pass built inside the window as new. TF's own such check,
``test_util.assert_no_new_pyobjects_executing_eagerly``, runs its body twice
to warm caches and then three times counting: a key used once per run
reaches its build inside the counted runs. So in ``auto`` mode no pass is
built while that check runs (passes built before it are replayed; other
keys run eagerly); ``always`` and ``verify`` build as they always do.

``FASTTAPE_COMPILED_BACKWARD``: ``auto`` (default: compile a key when its
costs say so, never on its first use), ``always`` (on its first use), ``off``, or ``verify`` (for
tests: as ``always``, but a pass that cannot be compiled or disagrees raises
AssertionError, and the compiled result is returned on the first use too,
so parity tests compare it with TF's).
"""

import collections
import os
import sys
import threading
import time

import numpy as np

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context
from tensorflow.python.eager import def_function
from tensorflow.python.eager import execute
from tensorflow.python.framework import config as tf_config
from tensorflow.python.framework import constant_op
from tensorflow.python.framework import dtypes
from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_spec
from tensorflow.python.ops import gen_math_ops
from tensorflow.python.ops import math_ops
from tensorflow.python.platform import tf_logging as logging

from fasttape.gradients._payloads import (EagerOp, backward_signature,
                                          bake_slot, words_hash)
from fasttape.gradients._tf_vspace import TFVSpace

MODES = ("auto", "always", "off", "verify")
_MAX_ENTRIES = 64        # compiled functions kept (least recently used dropped)
_MAX_COUNTS = 4096       # keys seen but not built, remembered

HORIZON = 200            # loop steps expected ahead, at the least
# A steady key used once every `gap` gradient calls, gap at most this, is
# one of a few keys in turn in each step of a loop (a GAN's two updates, a
# plain and a DP-SGD step): HORIZON steps ahead are HORIZON of its uses,
# as for a loop over one key. (A key seen at larger equal gaps is held to
# HORIZON calls: a length drawn from many repeats so by chance.)
MAX_KEYS_IN_TURN = 4
# Build cost model (seconds), until builds in this process are measured:
# a fixed part plus a part per backward op (measured on this project's CPU,
# the first build of a fresh process: 0.4 to 1.1 ms an op, the bench's rnn
# 322 ops in 0.15 s, a chain of 400 sin * x in 0.42 s), of which
# instantiation (the first call) is 10-25%. (At 2 ms an op, a fixed-shape
# RNN whose eager pass takes 3.6 ms was never built in a fresh process.) A
# compiled pass took about 35% of the eager pass's time on the bench's
# workloads (learning it from the passes built would let one small pass's
# ratio decide for every other).
_BUILD_FIXED = 0.005
_BUILD_PER_ENTRY = 0.001
_INSTANTIATION_SHARE = 0.15
_COMPILED_SHARE = 0.35
_PRIOR_ENTRIES = 100     # weight of the defaults, in backward ops built
# What compiling saves is Python's dispatch per op, not the kernels' work:
# at most this per backward op (chain of sin * x: 16 ms eager against 3 ms
# compiled for 400 ops, 33 us an op); compute-bound passes (attention over
# long sequences) save less than _COMPILED_SHARE says.
_SAVING_PER_ENTRY = 30e-6

# Backward ops of the largest pass built in ``auto`` mode. Tracing one
# costs about 1 ms and 40 KB an op while it is built (a chain of 10,000 ops:
# 8 s and 400 MB; 200,000: minutes and over 15 GB), which the cost model's
# time alone would accept for a long loop; a pass over more runs eagerly,
# as TF's tape runs it, and is not even keyed (its signature would cost a
# millisecond every thousand ops, for nothing).
_MAX_BUILT_ENTRIES = 10_000

# Constant-foldable bytes a traced pass may hold (see "Never worse than
# TF's eager tape"): TF's instantiation evaluates them all, twice over.
_MAX_FOLDED_BYTES = 1 << 20
# Ops TF's constant folding never evaluates (besides stateful ones).
_NOT_FOLDED = frozenset({"Placeholder", "Switch", "Merge", "Enter", "Exit",
                         "NextIteration", "LoopCond", "RefSwitch",
                         "RefMerge", "RefEnter", "RefExit",
                         "RefNextIteration"})
# The frames of TF's object-counting leak check (see "What a leak check sees").
_OBJECT_CHECK = "assert_no_new_pyobjects_executing_eagerly."

_FAILED = "failed"
# The stats counters of a gradient call the cache saw in auto/always/verify
# (not "skipped": mode off, profiling, higher order...): a hit rate is
# replayed over their sum.
CALL_STATS = ("replayed", "eager", "eager_after_clear", "built", "slower",
              "failed", "churn_skipped", "too_large")
# The stats counters of a call that built a pass or instantiated one again
# (tried to: "slower" and "failed" ones paid for the build too).
BUILD_STATS = ("built", "slower", "failed", "post_built", "traced_failed",
               "reinstantiated", "traced_reinstantiated")


def builds():
    """How many passes this process has built or instantiated again (a step
    that moved it paid a one-time cost)."""
    stats = CACHE.stats
    return sum(stats[k] for k in BUILD_STATS)


STEADY_GAPS = 3          # equal gaps between uses that make a key steady
# Key churn: after this many gradient calls in a row that neither replayed
# nor built a pass (shapes that change every step), a pass's key is
# computed on one call in _CHURN_SAMPLE only (the others run eagerly at
# once): what the keys cost is then a quarter, and a key that repeats is
# still seen (its counts grow four times slower, so it is built later).
_CHURN_CALLS = 16
_CHURN_SAMPLE = 4


class _Seen:
    """What the cache knows about a key: its uses, the gradient calls it
    was first and last seen at and the gap between its last two uses, the
    kernel-cache epoch it was first seen in, and its fastest eager pass."""

    __slots__ = ("uses", "first", "last", "gap", "run", "epoch",
                 "eager_seconds")

    def __init__(self, call, epoch):
        self.uses = 0
        self.first = self.last = call
        self.gap = 0
        self.run = 0     # consecutive gaps equal to the last one
        self.epoch = epoch
        self.eager_seconds = float("inf")

    def use(self, call):
        """Count a use at gradient call ``call``."""
        if self.uses:
            gap = call - self.last
            self.run = self.run + 1 if gap == self.gap else 1
            self.gap = gap
        self.uses += 1
        self.last = call

    @property
    def steady(self):
        """Its last STEADY_GAPS gaps are equal: a loop over one key, or a
        few in turn. Two were not enough: a length drawn at random from a
        few often repeats at equal gaps twice (the bench's varlen_rnn and
        varlen_attention built passes that way which never paid)."""
        return self.run >= STEADY_GAPS


class _Cache:
    def __init__(self, mode):
        self.set_mode(mode)
        self.lock = threading.Lock()
        self.compiled = collections.OrderedDict()   # key -> _Compiled or _FAILED
        self.seen = {}                              # key -> _Seen
        self.stats = collections.Counter()          # replayed / built / ...
        # False (tests): every key is built at its second use and kept,
        # even where its costs say it does not pay, or it is slower.
        self.keep_faster = True
        # Kernel-cache clears (TFE_ContextClearCaches) since the process
        # started: a compiled pass last instantiated in an earlier epoch
        # is instantiated again by its next call.
        self.epoch = 0
        self.misses = 0          # gradient calls in a row that missed
        self.sampled = 0         # of which, during churn
        self._reset_estimates()

    def _reset_estimates(self):
        self.calls = 0           # gradient calls that got a key
        self.build_seconds = 0.0  # spent building (tracing + first calls)
        self.instantiation_seconds = 0.0   # of which first calls
        self.built_entries = 0
        self.builds_measured = 0
        self.per_entry = _BUILD_PER_ENTRY
        self.instantiation_share = _INSTANTIATION_SHARE

    def store(self, key, compiled):
        """Keep ``compiled`` (or _FAILED) under ``key``, the oldest key
        going past _MAX_ENTRIES."""
        with self.lock:
            self.compiled[key] = compiled
            if compiled is not _FAILED:
                compiled.key = key
            while len(self.compiled) > _MAX_ENTRIES:
                _, old = self.compiled.popitem(last=False)
                if old is not _FAILED:
                    old.evicted = True

    def kernels_cleared(self):
        """TF dropped the instantiated kernels of every traced function."""
        self.epoch += 1
        self.stats["kernel_clears"] += 1

    def build_estimate(self, n_entries):
        return _BUILD_FIXED + self.per_entry * n_entries

    def uses_ahead(self, seen):
        """The uses of a key expected from now on: at its rate of use since
        it was first seen, over as many gradient calls as it has been seen
        for (a key is likely to last as long again) or, for a steady key
        (a fixed-shape loop), HORIZON loop steps if that is longer: HORIZON
        calls, times its gap for one of at most MAX_KEYS_IN_TURN keys used
        in turn."""
        age = self.calls - seen.first + 1
        if seen.steady:
            steps = seen.gap if seen.gap <= MAX_KEYS_IN_TURN else 1
            return seen.uses / age * max(HORIZON * steps, age)
        return seen.uses

    def instantiations_per_use(self, seen):
        """Kernel-cache clears since the key was first seen, per use of it
        (each costs a re-instantiation of its pass), at most one."""
        return min(1.0, (self.epoch - seen.epoch) / seen.uses)

    def learn_build(self, n_entries, trace_seconds, first_call_seconds):
        """Pool a measured build into the estimates: seconds per backward op
        and the share of instantiation, over all builds so far and a prior
        worth _PRIOR_ENTRIES ops at the defaults (pooled, so that one odd
        pass, or one slow moment of a loaded machine, does not decide)."""
        total = trace_seconds + first_call_seconds
        self.build_seconds += total
        self.instantiation_seconds += first_call_seconds
        self.built_entries += n_entries
        self.builds_measured += 1
        variable = self.build_seconds - _BUILD_FIXED * self.builds_measured
        self.per_entry = ((_BUILD_PER_ENTRY * _PRIOR_ENTRIES + max(variable, 0.0))
                          / (_PRIOR_ENTRIES + self.built_entries))
        prior = _BUILD_PER_ENTRY * _PRIOR_ENTRIES
        self.instantiation_share = (
            (_INSTANTIATION_SHARE * prior + self.instantiation_seconds)
            / (prior + self.build_seconds))

    def worth_building(self, seen, n_entries):
        """Should a key seen as ``seen`` (this use counted) be built now?"""
        if seen.uses < 2:
            return False
        if not self.keep_faster:
            return True
        build = self.build_estimate(n_entries)
        saving = (min(seen.eager_seconds * (1.0 - _COMPILED_SHARE),
                      _SAVING_PER_ENTRY * n_entries)
                  - build * self.instantiation_share
                  * self.instantiations_per_use(seen))
        return saving * self.uses_ahead(seen) >= build

    def worth_instantiating(self, compiled):
        """Should a pass whose kernels were dropped be called (and so
        instantiated again) now, or this step run eagerly?"""
        if not self.keep_faster:
            return True
        seen = compiled.seen
        ahead = self.uses_ahead(seen)
        clears = self.epoch - seen.epoch
        if clears:
            ahead = min(ahead, seen.uses / clears)   # before the next clear
        return compiled.saving * ahead >= compiled.instantiation_seconds

    def set_mode(self, mode):
        if mode not in MODES:
            raise ValueError(f"compiled backward mode must be one of {MODES}, "
                             f"got {mode!r}")
        self.mode = mode

    def clear(self):
        with self.lock:
            if _in_forked_child:
                _kept_in_child.extend(self.compiled.values())
            for compiled in self.compiled.values():
                if compiled is not _FAILED:
                    compiled.evicted = True
            self.compiled.clear()
            self.seen.clear()
            self.stats.clear()
            self.misses = self.sampled = 0
            self._reset_estimates()


CACHE = _Cache(os.environ.get("FASTTAPE_COMPILED_BACKWARD", "auto"))

# Set in a forked child: no compiled pass is built or called there.
_in_forked_child = False
# Passes held in a forked child are never released there: releasing one
# removes its function from TF's context, a call into TF's runtime that a
# forked child may not return from.
_kept_in_child = []


def _after_fork_in_child():
    global _in_forked_child
    _in_forked_child = True
    # Another thread may have held the lock at the fork: the child's copy
    # would never be released.
    CACHE.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def kernels_cleared():
    """Called by fasttape's wrapper of ``TFE_ContextClearCaches``."""
    CACHE.kernels_cleared()


def set_mode(mode):
    """One of MODES (see the module docstring); returns the previous mode."""
    previous = CACHE.mode
    CACHE.set_mode(mode)
    return previous


# Names of op inputs that configure an op rather than carry data (an axis, a
# shape, a permutation...): TF's eager gradient functions read their values.
CONFIG_INPUT_NAMES = frozenset({
    "axis", "reduction_indices", "shape", "perm", "begin", "end", "strides",
    "size", "paddings", "multiples", "dim", "split_dim", "size_splits",
    "num_segments", "block_shape", "crops", "ksize", "axes", "dims",
    "output_shape", "input_sizes", "filter_sizes", "orig_input_shape",
    "s0", "s1", "depth", "k", "num_lower", "num_upper", "shift",
    "element_shape", "num_elements", "concat_dim", "num_rows", "num_cols",
})

CONFIG_INPUTS = {}    # op type -> frozenset of config input indices


def config_inputs_of(op_type):
    """The indices of op_type's configuration inputs (cached in
    CONFIG_INPUTS): counted from the front for arguments before a list
    argument (ConcatV2's values), from the back (negative) after it."""
    found = CONFIG_INPUTS.get(op_type)
    if found is not None:
        return found
    indices = set()
    try:
        args = list(op_def_registry.get(op_type).input_arg)
    except Exception:  # pylint: disable=broad-except
        args = []
    is_list = [bool(a.number_attr or a.type_list_attr) for a in args]
    first_list = is_list.index(True) if any(is_list) else len(args)
    last_list = len(args) - 1 - is_list[::-1].index(True) if any(is_list) else -1
    for i, a in enumerate(args):
        if a.name not in CONFIG_INPUT_NAMES:
            continue
        if i < first_list:
            indices.add(i)
        elif i > last_list:
            indices.add(i - len(args))
    found = frozenset(indices)
    CONFIG_INPUTS[op_type] = found
    return found


def _add_n_in_order(xs):
    """The sum TF's AddN kernel (aggregate_ops.h) computes from its inputs
    in order, as AddV2 ops: the first r = n % 8 inputs (8 or 9 for 0 or 1)
    added left to right, then each further group of 8, itself added left
    to right, added to that."""
    r = len(xs) % 8
    r = r + 8 if r < 2 else r
    total = xs[0]
    for x in xs[1:r]:
        total = gen_math_ops.add_v2(total, x)
    for k in range(r, len(xs), 8):
        group = xs[k]
        for x in xs[k + 1:k + 8]:
            group = gen_math_ops.add_v2(group, x)
        total = gen_math_ops.add_v2(total, group)
    return total


class _BuildVSpace(TFVSpace):
    """The TF vspace, run while tracing: each real payload is swapped for
    its symbolic stand-in, so the registered gradient functions build the
    graph of the pass."""

    def __init__(self, stand_ins, recompute=None):
        super().__init__()
        self.use_fast_rules = False
        self._stand_ins = stand_ins
        self._recompute = recompute

    def call_backward(self, op_type, payload, unneeded_indices, out_grads):
        stand_in = self._stand_ins[id(payload)]
        recompute = self._recompute
        if recompute is not None:
            resolved = recompute.resolve(stand_in, out_grads)
            if resolved is not stand_in:
                grads = self._call_backward(op_type, resolved,
                                            unneeded_indices, out_grads)
                recompute.returned(grads)
                return grads
        return self._call_backward(op_type, stand_in, unneeded_indices,
                                   out_grads)

    def aggregate(self, grads):
        # TF's eager AddN sums its inputs in order. In a graph, its kernel
        # first moves an input whose buffer it may reuse (one nothing else
        # reads) to the front, and so sums in another order: the last bits
        # would differ from the eager pass (TF's). Three or more dense
        # gradients are summed by the additions the eager AddN kernel
        # makes, one AddV2 each (two commute: their sum cannot differ;
        # integer sums do not depend on the order; variants are summed by
        # AddN alone).
        if len(grads) < 3 or all(isinstance(g, indexed_slices.IndexedSlices)
                                 for g in grads):
            return super().aggregate(grads)
        dtype = grads[0].dtype
        if not (dtype.is_floating or dtype.is_complex):
            return super().aggregate(grads)
        return _add_n_in_order([ops.convert_to_tensor(g) for g in grads])


# Grappler, when a pass is instantiated: its model pruner alone, which
# changes no arithmetic. A traced pass computes every gradient its gradient
# functions return and takes every tensor the tape saved for them, needed or
# not (the bench's rnn: 857 nodes, 363 arguments); the pruner removes what
# no output needs (there: 610 nodes, 161 arguments read; its cnn's
# gradient for the input image), and Identity nodes. A call in a step then
# took 15% less time on rnn, 10% less on cnn, for a few per cent more
# instantiation time. The other optimizers stay off: the whole
# meta-optimizer took about half of a build (a 400-op pass: 1.0 s with it,
# 0.2 s without), and its arithmetic, layout and remapping rewrites
# (fusions, reordered sums) could change the last bits of a gradient
# against the eager pass it must equal.
_RC = rewriter_config_pb2.RewriterConfig


def _pruning_only(rewrite_options):
    """Turn every Grappler optimizer in ``rewrite_options`` (a
    RewriterConfig) off but the model pruner."""
    for field in _RC.DESCRIPTOR.fields:
        if field.enum_type is not None and field.enum_type.name == "Toggle":
            setattr(rewrite_options, field.name, _RC.OFF)
    rewrite_options.memory_optimization = _RC.NO_MEM_OPT
    rewrite_options.meta_optimizer_iterations = _RC.ONE
    rewrite_options.disable_tfg_optimizer = True
    rewrite_options.disable_model_pruning = False
    rewrite_options.disable_meta_optimizer = False
    rewrite_options.min_graph_nodes = -1    # (small graphs too)
    del rewrite_options.optimizers[:]
    del rewrite_options.custom_optimizers[:]


class _Compiled:
    """One traced backward pass: a graph function and how to rebuild its
    flat outputs into one gradient (or None) per source.

    It runs on TF's single-threaded executor (kernels inline on the calling
    thread: no hand-off to sleeping inter-op threads, which costs more than
    the small kernels of a backward pass) unless that executor refuses the
    graph (asynchronous or control-flow kernels): then on the default one;
    and it is instantiated with Grappler's model pruner alone
    (_pruning_only).
    """

    def __init__(self, function, kinds):
        self.function = function   # kept: the context drops its definition with it
        self.kinds = kinds    # per source: 0 None, 1 tensor, 2/3 IndexedSlices with/without dense_shape
        self.name = function.name.decode()
        self.num_outputs = len(function.function_type.flat_outputs)
        self.use_executor("SINGLE_THREADED_EXECUTOR")
        # For the cache's decisions (see _Cache.worth_instantiating).
        self.epoch = CACHE.epoch   # kernel-cache epoch of its instantiation
        self.seen = _Seen(0, self.epoch)   # its uses (see _Cache.uses_ahead)
        self.saving = 0.0          # seconds per call against the eager pass
        self.instantiation_seconds = 0.0
        self.evicted = False       # no longer in CACHE.compiled
        self.key = None            # its key in CACHE.compiled
        self.recompute_peak = 0    # (a memory budget's pass, see GraphRecompute)
        self.recompute_ops = 0     # recomputed bytes alive at once, ops re-run

    def use_executor(self, executor_type):
        attrs = dict(context.context().function_call_options.as_attrs())
        attrs["executor_type"] = executor_type
        config = config_pb2.ConfigProto()
        config.ParseFromString(attrs["config_proto"])
        _pruning_only(config.graph_options.rewrite_options)
        attrs["config_proto"] = config.SerializeToString(deterministic=True)
        self.executor_type = executor_type
        self.attrs = tuple(x for kv in attrs.items() for x in kv)

    def __call__(self, feeds):
        if not self.num_outputs:
            return _unflatten((), self.kinds)
        outs = execute.execute(self.name, self.num_outputs, feeds, self.attrs,
                               context.context())
        return _unflatten(outs, self.kinds)

    def first_call(self, feeds):
        """The first call, falling back to the default executor."""
        try:
            return self(feeds)
        except Exception:  # pylint: disable=broad-except
            self.use_executor("")
            return self(feeds)


def _warm_seconds(compiled, feeds):
    """The faster of two warm calls of ``compiled``."""
    seconds = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        compiled(feeds)
        seconds = min(seconds, time.perf_counter() - start)
    return seconds


# A pass of large kernels (a convolution's input and filter gradients) runs
# faster on TF's default executor, which runs independent kernels at once on
# its inter-op threads; a pass of many small ones, inline on the
# single-threaded one. A pass whose warm call takes more than this per op
# is timed on both when it is built, and keeps the default executor where
# that is faster by the margin (the bench's cnn: 5-10% faster; its rnn, of
# small kernels, 10% slower).
TRY_DEFAULT_EXECUTOR_SECONDS_PER_OP = 40e-6
_EXECUTOR_MARGIN = 0.95


def _pick_executor(compiled, feeds, seconds, n_entries):
    """Keep the faster executor for ``compiled`` (see above); returns its
    warm seconds."""
    if (compiled.executor_type != "SINGLE_THREADED_EXECUTOR"
            or seconds < TRY_DEFAULT_EXECUTOR_SECONDS_PER_OP * n_entries):
        return seconds
    compiled.use_executor("")
    try:
        compiled(feeds)     # (instantiated for this executor)
        other = _warm_seconds(compiled, feeds)
    except Exception:  # pylint: disable=broad-except
        other = float("inf")
    if other < seconds * _EXECUTOR_MARGIN:
        CACHE.stats["default_executor"] += 1
        return other
    compiled.use_executor("SINGLE_THREADED_EXECUTOR")
    return seconds


def _flatten(grads):
    flat, kinds = [], []
    for g in grads:
        if g is None:
            kinds.append(0)
        elif isinstance(g, indexed_slices.IndexedSlices):
            flat.extend([g.values, g.indices])
            if g.dense_shape is None:
                kinds.append(3)
            else:
                flat.append(g.dense_shape)
                kinds.append(2)
        else:
            flat.append(g)
            kinds.append(1)
    return flat, tuple(kinds)


def _unflatten(outs, kinds):
    result, i = [], 0
    for kind in kinds:
        if kind == 0:
            result.append(None)
        elif kind == 1:
            result.append(outs[i])
            i += 1
        elif kind == 2:
            result.append(indexed_slices.IndexedSlices(outs[i], outs[i + 1],
                                                       outs[i + 2]))
            i += 3
        else:
            result.append(indexed_slices.IndexedSlices(outs[i], outs[i + 1]))
            i += 2
    return result


def _spec(t):
    return tensor_spec.TensorSpec(t._shape_tuple(), t.dtype)  # pylint: disable=protected-access


def _build(core, entries, feeds, target_ids, source_ids, sources_that_are_targets,
           output_gradients, target_meta, all_watched, post=None,
           recompute=None):
    """Trace the pass (and ``post``, see gradient()) into a graph function;
    a reason (str) if it is not compiled. ``recompute``: see gradient()."""
    given = [] if output_gradients is None else [
        g for g in output_gradients if g is not None]
    specs = [_spec(t) for t in feeds] + [_spec(g) for g in given]
    if post is not None:
        specs += [_spec(t) for t in post[2]]
    if recompute is not None:
        specs += [_spec(t) for t in recompute.feeds]
    kinds_box = []

    def backward(*args):
        args = iter(args)
        stand_ins = {}
        for i, entry in enumerate(entries):
            p = entry.payload
            configs = config_inputs_of(entry.op_type)
            n_in = p.num_inputs
            saved = tuple([
                None if x is None
                else recompute.marker(i, k) if type(x) is not ops.EagerTensor
                else constant_op.constant(x.numpy()) if bake_slot(configs, k, n_in, x)
                else next(args) for k, x in enumerate(p.saved)])
            stand_ins[id(p)] = EagerOp(p.attrs, saved, p.num_inputs)
        ogs = None if output_gradients is None else [
            None if g is None else next(args) for g in output_gradients]
        if recompute is not None:
            recompute.bind([next(args) for _ in recompute.feeds])
        grads = core.compute_gradient(
            _BuildVSpace(stand_ins, recompute), target_ids, source_ids,
            sources_that_are_targets, ogs, True, True, target_meta,
            all_watched)
        if post is not None:
            grads = post[1](grads, *args)
        flat, kinds = _flatten(grads)
        kinds_box.append(kinds)
        return flat

    fn = def_function.function(backward, input_signature=specs,
                               autograph=False)
    concrete = fn.get_concrete_function()
    if concrete.captured_inputs:
        # It read an eager tensor by value: not replayable.
        return "the trace captured an eager tensor"
    folded = _foldable_bytes(concrete.graph)
    if folded > _MAX_FOLDED_BYTES:
        return (f"its graph holds {folded} bytes that TF's instantiation "
                f"would constant-fold (at most {_MAX_FOLDED_BYTES})")
    compiled = _Compiled(concrete._inference_function, kinds_box[0])  # pylint: disable=protected-access
    if recompute is not None:
        compiled.recompute_peak, compiled.recompute_ops = recompute.finish()
    return compiled


def _foldable_bytes(graph):
    """The bytes of every tensor of ``graph`` that TF's constant folding
    (common_runtime/constant_folding.cc, run when a function is
    instantiated) would evaluate: the outputs of constants and of stateless
    ops whose inputs, control inputs included, are all foldable. An output
    whose size the graph does not know (BroadcastGradientArgs, the shape
    arithmetic of gradient functions) counts as large as the op's inputs
    (any output of a constant-shaped Fill, Tile or broadcast has a known
    size)."""
    foldable = set()   # op names
    sizes = {}         # foldable tensor name -> bytes
    total = 0
    for op in graph.get_operations():      # in creation order: topological
        if op.type == "Const":
            if op.control_inputs:
                continue
        elif (op.type in _NOT_FOLDED or not op.inputs
              or op.op_def.is_stateful
              or any(t.op.name not in foldable for t in op.inputs)
              or any(c.name not in foldable for c in op.control_inputs)):
            continue
        foldable.add(op.name)
        inputs = sum(sizes[t.name] for t in op.inputs)
        for t in op.outputs:
            n = t.shape.num_elements()
            size = inputs if n is None else n * max(t.dtype.size, 1)
            sizes[t.name] = size
            total += size
    return total


def _inside_object_check():
    """Is TF's object-counting leak check running further up this stack?"""
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        code = frame.f_code
        # co_qualname from Python 3.11; before it, the check's own locals.
        qualname = getattr(code, "co_qualname", None)
        if (qualname.startswith(_OBJECT_CHECK) if qualname is not None else
                code.co_name == "decorator"
                and "registered_function_names" in code.co_varnames):
            return True
        frame = frame.f_back
    return False


_TOLERANCE = {dtypes.float16: 1e-2, dtypes.bfloat16: 2e-2,
              dtypes.float32: 1e-4, dtypes.complex64: 1e-4,
              dtypes.float64: 1e-9, dtypes.complex128: 1e-9}


def _dense(g):
    if isinstance(g, indexed_slices.IndexedSlices):
        if g.dense_shape is None:
            return None
        return math_ops.unsorted_segment_sum(g.values, g.indices,
                                             g.dense_shape[0]).numpy()
    return g.numpy()


def _same(eager, compiled):
    """Do the compiled gradients match the eager ones (kinds, dtypes,
    shapes, values within the dtype's tolerance)?"""
    if len(eager) != len(compiled):
        return False
    for a, b in zip(eager, compiled):
        if (a is None) != (b is None):
            return False
        if a is None:
            continue
        if (isinstance(a, indexed_slices.IndexedSlices) !=
                isinstance(b, indexed_slices.IndexedSlices)):
            return False
        dtype = a.dtype
        if dtype != b.dtype:
            return False
        x, y = _dense(a), _dense(b)
        if x is None or y is None or x.shape != y.shape:
            return False
        tol = _TOLERANCE.get(dtype)
        if tol is None:
            if not np.array_equal(x, y):
                return False
            continue
        x = x.astype(np.complex128 if dtype.is_complex else np.float64)
        y = y.astype(x.dtype)
        finite = np.isfinite(x)
        if not (np.array_equal(finite, np.isfinite(y)) and np.array_equal(
                x[~finite], y[~finite], equal_nan=True)):
            return False
        x, y = x[finite], y[finite]
        scale = max(1.0, float(np.max(np.abs(x)))) if x.size else 1.0
        if not np.allclose(x, y, rtol=tol, atol=tol * scale):
            return False
    return True


_determinism = tf_config.is_op_determinism_enabled


def _then(eager_pass, post):
    """The eager pass followed by ``post`` (see gradient())."""
    def run():
        return post[1](eager_pass(), *post[2])
    return run


def _skipped(eager_pass):
    CACHE.stats["skipped"] += 1
    return eager_pass()


def _off_now(cache, vspace):
    """No pass is compiled or replayed now: the cache is off, a forked
    child, per-op gradient hooks (profiling, checks), recording (higher
    order), a profiler, or graph mode."""
    return (cache.mode == "off" or _in_forked_child
            or vspace.profile_stats is not None
            or vspace.check_gradients is not None
            or sys.getprofile() is not None or vspace._is_recording()  # pylint: disable=protected-access
            or not context.executing_eagerly())


class _Key:
    """A pass's cache key with its hash computed once: ``items`` are the
    plan's code (bytes of int64 words) and what follows it. The key of a
    300-op pass holds thousands of words, which Python would hash anew at
    every dict lookup (twice per replay: the lookup and the move to the
    end of the LRU order), and the code through SipHash: its words are
    hashed by words_hash, the signature's as they were written. A replay
    compares it with the stored key once, by value; the move finds the
    stored key itself (``_Compiled.key``), by identity."""

    __slots__ = ("items", "_hash")

    def __init__(self, items):
        self.items = items
        # (TypeError: an attr that cannot be a key)
        self._hash = hash((words_hash(items[0]),) + items[1:])

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (type(other) is _Key and self._hash == other._hash
                                 and self.items == other.items)

    def __getitem__(self, i):
        return self.items[i]


class Remembered:
    """A post pass gradient() replayed, for a caller that knows where its
    feeds are without the plan (dp_gradient's fused pass, on the ops of a
    path whose analysis matched: the same structure, so the same key):
    ``replay`` calls it while the cache keeps it, with the key's device
    and determinism. ``slots``: where each feed of the pass is among the
    plan's ``payloads``, (payload index, slot), until rebase(). ``key`` is
    gradient()'s: its items 2, 5 and 6 are the targets' metas, the device
    scope and determinism."""

    __slots__ = ("compiled", "key", "device", "determinism", "payloads",
                 "slots")

    def __init__(self, compiled, key, entries):
        self.compiled, self.key = compiled, key
        self.device, self.determinism = key[5], key[6]
        self.slots = []
        backward_signature(entries, CONFIG_INPUTS, config_inputs_of,
                           self.slots)
        self.payloads = [e.payload for e in entries]

    def rebase(self, entries):
        """Its slots as (index in ``entries``, slot), where ``entries``
        hold every payload of its plan; it then holds no payload (nor so
        any tensor). False if one is not among them."""
        at = {id(e.payload): j for j, e in enumerate(entries)}
        slots = [(at.get(id(self.payloads[i])), k) for i, k in self.slots]
        self.payloads = None
        if any(j is None for j, _ in slots):
            return False
        self.slots = tuple(slots)
        return True


def _call_cached(cache, compiled, feeds, post, traced=False):
    """A cached pass called on ``feeds`` as a replay (``post``: a post
    pass; ``traced``: traced_call()'s, no gradient call, counted apart),
    instantiated again (and timed) if its kernels were cleared; counted in
    the stats. None if the call failed: a kernel error (a CheckNumerics
    gradient on this step's values, an allocation that failed), for the
    caller's eager pass to meet again."""
    prefix = "traced_" if traced else ""
    try:
        if compiled.epoch != cache.epoch:
            start = time.perf_counter()
            grads = compiled(feeds)
            compiled.instantiation_seconds = time.perf_counter() - start
            compiled.epoch = cache.epoch
            cache.stats[prefix + "reinstantiated"] += 1
        else:
            grads = compiled(feeds)
    except Exception:  # pylint: disable=broad-except
        cache.stats[prefix + "replay_failed"] += 1
        return None
    if post:
        cache.stats["post_replayed"] += 1
    if not traced:
        cache.stats["replayed"] += 1
        cache.misses = 0
    return grads


def replay(remembered, feeds, vspace, target_meta):
    """The remembered pass called on ``feeds`` (the plan's, then the post
    pass'), as gradient() replays a cached post pass, or None where
    gradient() must decide instead (the pass left the cache, the targets'
    metas, the device scope or determinism changed, the cache is off now,
    or the call failed)."""
    cache = CACHE
    compiled = remembered.compiled
    if (compiled.evicted or tuple(target_meta) != remembered.key[2]
            or _off_now(cache, vspace)
            or context.context().device_name != remembered.device
            or _determinism() != remembered.determinism):
        return None
    try:
        cache.compiled.move_to_end(remembered.key)
    except KeyError:    # (another thread's step pushed it out just now)
        return None
    cache.calls += 1
    compiled.seen.use(cache.calls)
    return _call_cached(cache, compiled, feeds, True)


def gradient(core, vspace, target_ids, source_ids, sources_that_are_targets,
             output_gradients, retain, target_meta, eager_pass,
             all_watched=False, post=None, remember=None, recompute=None):
    """The pass through the cache: the gradients, computed by a compiled
    function when the key allows, else by ``eager_pass()``.

    ``post`` = (key, fn, feeds): what is returned is then ``fn(gradients,
    *feeds)`` (fn runs eagerly and traced alike: dp_gradient's post-pass),
    compiled into the same function as the pass; ``key`` (hashable) says
    what fn computes besides its feeds' values. Such a key is built at its
    second use, and kept when it agrees, as traced_call() builds and keeps
    (the cost model above weighs the backward ops alone), it is never
    left to key churn's sampling, and after a kernel-cache clear it is
    instantiated again (its saving is not measured).

    ``remember`` (a list): a replayed post pass appends its Remembered to
    it (see replay()).

    ``recompute``: a memory budget's pass (recording._budget.GraphRecompute):
    a payload's saved items that are no tensors (dropped ones) are
    described by ``recompute.hook`` in the signature, and recomputed inside
    the function from ``recompute.feeds`` (fed last; no post with it)."""
    if post is not None:
        eager_pass = _then(eager_pass, post)
    # (In helpers, so that this frame is short up to the replay: TF records
    # the Python stack, with the line of each frame, at every op it runs,
    # the compiled pass's one included, and the line of a frame costs more
    # the further into its function it is.)
    found = _look_up(core, vspace, target_ids, source_ids, output_gradients,
                     target_meta, eager_pass, all_watched, post, recompute)
    if type(found) is not _Lookup:
        return found    # (the gradients: computed eagerly)
    if found.compiled is not None:
        return _replay_found(core, found, retain, post, remember, recompute)
    return _build_or_run(core, found, target_ids, source_ids,
                         sources_that_are_targets, output_gradients,
                         target_meta, all_watched, post, recompute,
                         eager_pass)


class _Lookup:
    """What gradient() found for a pass it may replay or build: its key,
    the cached compiled pass (or None), the plan's entries and the saved
    tensors to feed, and ``fed()`` (all the call's feeds) and ``unfed()``
    (the eager pass, with those lists let go)."""

    __slots__ = ("key", "compiled", "entries", "feeds", "fed", "unfed")

    def __init__(self, key, compiled, entries, feeds, fed, unfed):
        self.key, self.compiled = key, compiled
        self.entries, self.feeds = entries, feeds
        self.fed, self.unfed = fed, unfed


def _look_up(core, vspace, target_ids, source_ids, output_gradients,
             target_meta, eager_pass, all_watched, post, recompute):
    """gradient()'s plan, signature and key: a _Lookup, or the gradients
    where the pass runs eagerly (no compiled pass can serve it)."""
    cache = CACHE
    if _off_now(cache, vspace):
        return _skipped(eager_pass)
    if cache.mode == "auto" and cache.misses >= _CHURN_CALLS and post is None:
        cache.sampled += 1
        if cache.sampled % _CHURN_SAMPLE:
            cache.stats["churn_skipped"] += 1
            return eager_pass()
    plan = core.plan(target_ids, source_ids, all_watched)
    if plan is None:
        return _skipped(eager_pass)
    code, entries = plan
    if not entries:
        return _skipped(eager_pass)
    if cache.mode == "auto" and len(entries) > _MAX_BUILT_ENTRIES:
        cache.stats["too_large"] += 1
        entries.clear()     # (the eager pass lets the payloads go one by one)
        return eager_pass()
    signed = backward_signature(entries, CONFIG_INPUTS, config_inputs_of, None,
                                None if recompute is None else recompute.hook)
    if signed is None:
        return _skipped(eager_pass)
    signature, feeds = signed
    if recompute is not None:
        signature = (signature, recompute.signature())

    def unfed():
        # The pass runs eagerly: its gradient functions read the payloads'
        # tensors, which it lets go one by one (a memory budget counts on
        # it), so these lists must not hold them (nor the payloads)
        # meanwhile.
        feeds.clear()
        entries.clear()
        if recompute is not None:
            recompute.feeds.clear()
        return eager_pass()

    for meta in target_meta:
        if type(meta) is not tuple:
            return _skipped(unfed)
    og_sig = None
    if output_gradients is not None:
        og_sig = []
        for g in output_gradients:
            if g is None:
                og_sig.append(None)
            elif type(g) is not ops.EagerTensor:
                return _skipped(unfed)
            else:
                sig = (g._shape_tuple(), g._datatype_enum())  # pylint: disable=protected-access
                if sig != target_meta[len(og_sig)]:
                    # A seed that does not fit its target: TF's graph-mode
                    # gradients (static shapes) treat it unlike the eager
                    # ones, so such a pass stays eager (and fails, or not,
                    # as TF's eager pass does).
                    return _skipped(unfed)
                og_sig.append(sig)
        og_sig = tuple(og_sig)
    # The device scope places the call (as it places eager gradient ops);
    # the function's arguments are placed by where its feeds are.
    # Determinism is read by some gradient functions while they build ops.
    key = (code, signature, tuple(target_meta), og_sig, all_watched,
           context.context().device_name, _determinism())
    post_feeds = ()
    if post is not None:
        post_feeds = list(post[2])
        try:
            key += (post[0], tuple((f._shape_tuple(), f._datatype_enum())  # pylint: disable=protected-access
                                   for f in post_feeds))
        except AttributeError:      # a feed that is no eager tensor
            return _skipped(unfed)

    def fed():
        # What a call takes: the saved tensors, the output gradients given,
        # the post pass's feeds, the resident tensors a memory budget's
        # recomputations start from.
        feeds.extend(g for g in output_gradients or () if g is not None)
        feeds.extend(post_feeds)
        if recompute is not None:
            feeds.extend(recompute.feeds)
        return feeds

    try:
        key = _Key(key)
    except TypeError:       # an attr value that cannot be a key
        return _skipped(unfed)
    compiled = cache.compiled.get(key)
    cache.calls += 1
    if compiled is _FAILED:
        if recompute is not None:
            # (A budgeted pass that started lower for its replay, which
            # failed or was slower: it starts from the usual level again.)
            recompute.given_up()
        return _skipped(unfed)
    return _Lookup(key, compiled, entries, feeds, fed, unfed)


def _replay_found(core, found, retain, post, remember, recompute):
    """gradient()'s replay of a cached pass (or its eager pass, where the
    cache decides against the call, or the call fails)."""
    cache = CACHE
    compiled, unfed = found.compiled, found.unfed
    cache.compiled.move_to_end(compiled.key)
    compiled.seen.use(cache.calls)
    cleared = compiled.epoch != cache.epoch
    if (cleared and cache.mode == "auto" and post is None
            and not cache.worth_instantiating(compiled)):
        # Its kernels were dropped (a re-seed): instantiating them
        # again would cost more than the uses expected before the next
        # clear save.
        cache.stats["eager_after_clear"] += 1
        return unfed()
    if recompute is not None and recompute.refuse(
            compiled.recompute_peak) is not None:
        cache.stats["over_budget"] += 1
        return unfed()
    grads = _call_cached(cache, compiled, found.fed(), post is not None)
    if grads is None:
        # The eager pass, whose payloads are still alive, raises what
        # TF's tape raises (its op and message), or succeeds where
        # TF's does.
        return unfed()
    if recompute is not None:
        recompute.replayed(compiled.recompute_ops)
    if not (core.persistent or retain):
        core.release()
    if post is not None and remember is not None:
        remember.append(Remembered(compiled, compiled.key, found.entries))
    return grads


def _build_or_run(core, found, target_ids, source_ids, sources_that_are_targets,
                  output_gradients, target_meta, all_watched, post, recompute,
                  eager_pass):
    """gradient() for a key with no compiled pass: the eager pass, and the
    pass built when the key's uses pay for it (then checked against the
    eager pass, and timed)."""
    cache = CACHE
    key, entries, feeds = found.key, found.entries, found.feeds
    fed, unfed = found.fed, found.unfed
    seen = cache.seen.get(key)
    if seen is None:
        if len(cache.seen) >= _MAX_COUNTS:
            cache.seen.clear()
        seen = cache.seen[key] = _Seen(cache.calls, cache.epoch)
        cache.stats["new_keys"] += 1
    seen.use(cache.calls)
    if cache.mode == "auto" and (
            (seen.uses < 2 if post is not None
             else not cache.worth_building(seen, len(entries)))
            or _inside_object_check()):
        cache.misses += 1
        cache.stats["eager"] += 1
        start = time.perf_counter()
        grads = unfed()
        seen.eager_seconds = min(seen.eager_seconds,
                                 time.perf_counter() - start)
        if recompute is not None:
            recompute.ran_eagerly(seen.eager_seconds)
        return grads
    cache.seen.pop(key, None)
    cache.misses = 0
    verify = cache.mode == "verify"
    # Build while the payloads are alive, then run the eager pass (which
    # may release them) and check the two agree.
    why = None
    start = time.perf_counter()
    try:
        compiled = _build(core, entries, feeds, target_ids, source_ids,
                          sources_that_are_targets, output_gradients,
                          target_meta, all_watched, post, recompute)
        if isinstance(compiled, str):
            why, compiled = compiled, None
    except Exception as e:  # pylint: disable=broad-except
        why, compiled = f"tracing failed: {e!r}", None
    trace_seconds = time.perf_counter() - start
    refused = (compiled is not None and recompute is not None
               and recompute.refuse(compiled.recompute_peak))
    if refused and not verify:
        # A budgeted pass whose call would hold more than the budget
        # allows: never called, not even to be checked (verify mode, for
        # tests, checks it and does not keep it).
        logging.vlog(1, "fasttape: budgeted pass not compiled: %s", refused)
        cache.stats["over_budget"] += 1
        compiled = None
    start = time.perf_counter()
    grads = eager_pass()
    eager_seconds = min(seen.eager_seconds, time.perf_counter() - start)
    if recompute is not None:
        eager_seconds = recompute.ran_eagerly(eager_seconds)
    replayed = None
    slower = False
    if compiled is not None:
        fed()
        try:
            start = time.perf_counter()
            replayed = compiled.first_call(feeds)
            first_call_seconds = time.perf_counter() - start
            cache.learn_build(len(entries), trace_seconds, first_call_seconds)
            compiled.instantiation_seconds = first_call_seconds
            compiled.seen = seen
            if not _same(grads, replayed):
                why, compiled = "it disagrees with the eager pass", None
            elif refused:
                cache.stats["over_budget"] += 1
                compiled = None     # (verify mode) checked, not kept
            elif not verify and cache.keep_faster and post is None:
                # Small passes run faster op by op than through a function
                # call: keep whichever is faster (the first call above paid
                # for instantiation, so time warm calls: the faster of two
                # against the fastest eager pass seen for this key).
                compiled_seconds = _warm_seconds(compiled, feeds)
                if recompute is None:
                    # (A memory budget's pass stays on the single-threaded
                    # executor: the default one runs independent gradient
                    # functions at once, each with what it allocates; the
                    # allocator's peak of a small dense model's pass was
                    # twice as high on it, budget or not.)
                    compiled_seconds = _pick_executor(
                        compiled, feeds, compiled_seconds, len(entries))
                slower = compiled_seconds >= eager_seconds
                if slower and recompute is not None:
                    # A budgeted pass timed slower is run eagerly for good
                    # (and one from a lower start goes back to the usual
                    # level): timed again first (the eager pass it is
                    # weighed against is the fastest of several steps, the
                    # replay the faster of two calls), so that one busy
                    # moment on a loaded machine does not decide it.
                    compiled_seconds = min(compiled_seconds,
                                           _warm_seconds(compiled, feeds))
                    slower = compiled_seconds >= eager_seconds
                compiled.saving = eager_seconds - compiled_seconds
                if slower and recompute is not None:
                    recompute.given_up()
        except Exception as e:  # pylint: disable=broad-except
            why, compiled = f"it failed: {e!r}", None
    if why is not None:
        logging.vlog(1, "fasttape: backward pass not compiled: %s", why)
        if recompute is not None and recompute.too_many:
            # A budgeted pass that would re-run too much: not an error, in
            # verify mode either.
            cache.stats["over_budget"] += 1
        elif verify:
            raise AssertionError(f"fasttape: backward pass not compiled: {why}")
    cache.store(key, _FAILED if compiled is None or slower else compiled)
    cache.stats["slower" if slower else "built" if compiled is not None
                else "failed"] += 1
    if recompute is not None and replayed is not None and recompute.graph_ops:
        cache.stats["recompute_built"] += 1
    if post is not None and compiled is not None and not slower:
        cache.stats["post_built"] += 1
    # verify (tests): hand back the compiled result, so that parity tests
    # compare it with TF's.
    return replayed if verify and replayed is not None else grads


def traced_call(key, fn, feeds):
    """``fn(*feeds)`` (a list of tensors or None), run as one graph function
    cached under ``key`` (a hashable description of what ``fn`` computes
    besides its feeds' values), in the cache of the compiled backward
    passes: kept, counted and released with them (``fasttape.clear_caches()``).

    ``fn`` must compute the same in eager mode and traced (it is dp_gradient's
    post-pass: norms, clip factors, weighted sums, noise). Built at a key's
    second use (``auto``; dozens of small ops, a training loop repeats
    them), never while TF's object-counting leak check runs; on the call it
    is built, ``fn`` also runs eagerly, and the function is kept only if it
    agrees (not timed against it: one moment of a loaded machine would
    leave the key eager for good). Else, and in mode ``off``, under a
    profiler, in a forked child, ``fn`` runs eagerly."""
    cache = CACHE
    if (cache.mode == "off" or _in_forked_child or sys.getprofile() is not None
            or not context.executing_eagerly()):
        return fn(*feeds)
    try:
        key = ("traced", key, tuple(
            (f._shape_tuple(), f._datatype_enum()) for f in feeds),  # pylint: disable=protected-access
               context.context().device_name, _determinism())
        compiled = cache.compiled.get(key)
    except (TypeError, AttributeError):   # a feed that is no eager tensor
        return fn(*feeds)
    if compiled is _FAILED:
        return fn(*feeds)
    if compiled is not None:
        cache.compiled.move_to_end(compiled.key)
        out = _call_cached(cache, compiled, feeds, True, traced=True)
        return fn(*feeds) if out is None else out
    seen = cache.seen.get(key)
    if seen is None:
        if len(cache.seen) >= _MAX_COUNTS:
            cache.seen.clear()
        seen = cache.seen[key] = _Seen(cache.calls, cache.epoch)
    seen.use(cache.calls)
    if cache.mode == "auto" and (seen.uses < 2 or _inside_object_check()):
        return fn(*feeds)
    cache.seen.pop(key, None)
    verify = cache.mode == "verify"
    why, compiled, replayed = None, None, None
    kinds_box = []

    def traced(*args):
        flat, kinds = _flatten(fn(*args))
        kinds_box.append(kinds)
        return flat

    try:
        concrete = def_function.function(
            traced, input_signature=[_spec(f) for f in feeds],
            autograph=False).get_concrete_function()
        if concrete.captured_inputs:
            why = "the trace captured an eager tensor"
        elif _foldable_bytes(concrete.graph) > _MAX_FOLDED_BYTES:
            why = "its graph holds too many constant-foldable bytes"
        else:
            compiled = _Compiled(concrete._inference_function, kinds_box[0])  # pylint: disable=protected-access
        del concrete
    except Exception as e:  # pylint: disable=broad-except
        why = f"tracing failed: {e!r}"
    out = fn(*feeds)
    if compiled is not None:
        try:
            replayed = compiled.first_call(feeds)
            if not _same(out, replayed):
                why, compiled = "it disagrees with the eager run", None
        except Exception as e:  # pylint: disable=broad-except
            why, compiled = f"it failed: {e!r}", None
    if why is not None:
        logging.vlog(1, "fasttape: %s not compiled: %s", key[1][0], why)
        if verify:
            raise AssertionError(f"fasttape: {key[1][0]} not compiled: {why}")
    cache.store(key, _FAILED if compiled is None else compiled)
    cache.stats["post_built" if compiled is not None else "traced_failed"] += 1
    return replayed if verify else out
