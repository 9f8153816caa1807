"""Compiled backward passes: a repeated tape shape replays one graph function.

Training loops record the same program step after step. The core's
``plan`` gives the shape of a backward pass (which ops, how they connect)
and ``backward_signature`` the rest of what it depends on besides tensor
values (op types, attrs, dtypes and shapes of the tensors each gradient
reads). Together they key a cache. The second time a key is seen (``auto``),
the pass is traced once into a graph function by running the core's own
backward loop over symbolic stand-ins of the saved tensors, with TF's
registered gradient functions; from then on the whole backward pass is one
function call instead of hundreds of eager dispatches.

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

``FASTTAPE_COMPILED_BACKWARD``: ``auto`` (default: compile a key on its
second use), ``always`` (on its first use), ``off``, or ``verify`` (for
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

from fasttape import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
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
from tensorflow.python.ops import math_ops
from tensorflow.python.platform import tf_logging as logging

from fasttape._callback import EagerOp, backward_signature, bake_slot
from fasttape._tf_vspace import TFVSpace

MODES = ("auto", "always", "off", "verify")
_MAX_ENTRIES = 64        # compiled functions kept (least recently used dropped)
_MAX_COUNTS = 4096       # keys seen once, remembered

_FAILED = "failed"


class _Cache:
    def __init__(self, mode):
        self.set_mode(mode)
        self.lock = threading.Lock()
        self.compiled = collections.OrderedDict()   # key -> _Compiled or _FAILED
        self.seen = {}                              # key -> times seen
        self.stats = collections.Counter()          # replayed / built / ...
        self.keep_faster = True   # False (tests): keep compiled passes even if slower

    def set_mode(self, mode):
        if mode not in MODES:
            raise ValueError(f"compiled backward mode must be one of {MODES}, "
                             f"got {mode!r}")
        self.mode = mode

    def clear(self):
        with self.lock:
            self.compiled.clear()
            self.seen.clear()
            self.stats.clear()


CACHE = _Cache(os.environ.get("FASTTAPE_COMPILED_BACKWARD", "auto"))


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


class _BuildVSpace(TFVSpace):
    """The TF vspace, run while tracing: each real payload is swapped for
    its symbolic stand-in, so the registered gradient functions build the
    graph of the pass."""

    def __init__(self, stand_ins):
        super().__init__()
        self.use_fast_rules = False
        self._stand_ins = stand_ins

    def call_backward(self, op_type, payload, unneeded_indices, out_grads):
        return self._call_backward(op_type, self._stand_ins[id(payload)],
                                   unneeded_indices, out_grads)


class _Compiled:
    """One traced backward pass: a graph function and how to rebuild its
    flat outputs into one gradient (or None) per source.

    It runs on TF's single-threaded executor (kernels inline on the calling
    thread: no hand-off to sleeping inter-op threads, which costs more than
    the small kernels of a backward pass) unless that executor refuses the
    graph (asynchronous or control-flow kernels): then on the default one.
    """

    def __init__(self, function, kinds):
        self.function = function   # kept: the context drops its definition with it
        self.kinds = kinds    # per source: 0 None, 1 tensor, 2/3 IndexedSlices with/without dense_shape
        self.name = function.name.decode()
        self.num_outputs = len(function.function_type.flat_outputs)
        self.use_executor("SINGLE_THREADED_EXECUTOR")

    def use_executor(self, executor_type):
        attrs = dict(context.context().function_call_options.as_attrs())
        attrs["executor_type"] = executor_type
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
           output_gradients, target_meta, all_watched):
    """Trace the pass into a graph function; None if it cannot be."""
    given = [] if output_gradients is None else [
        g for g in output_gradients if g is not None]
    specs = [_spec(t) for t in feeds] + [_spec(g) for g in given]
    kinds_box = []

    def backward(*args):
        args = iter(args)
        stand_ins = {}
        for entry in entries:
            p = entry.payload
            configs = config_inputs_of(entry.op_type)
            n_in = p.num_inputs
            saved = tuple([
                None if x is None
                else constant_op.constant(x.numpy()) if bake_slot(configs, k, n_in, x)
                else next(args) for k, x in enumerate(p.saved)])
            stand_ins[id(p)] = EagerOp(p.attrs, saved, p.num_inputs)
        ogs = None if output_gradients is None else [
            None if g is None else next(args) for g in output_gradients]
        grads = core.compute_gradient(
            _BuildVSpace(stand_ins), target_ids, source_ids,
            sources_that_are_targets, ogs, True, True, target_meta,
            all_watched)
        flat, kinds = _flatten(grads)
        kinds_box.append(kinds)
        return flat

    fn = def_function.function(backward, input_signature=specs,
                               autograph=False)
    concrete = fn.get_concrete_function()
    if concrete.captured_inputs:
        return None       # it read an eager tensor by value: not replayable
    return _Compiled(concrete._inference_function, kinds_box[0])  # pylint: disable=protected-access


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


def _skipped(eager_pass):
    CACHE.stats["skipped"] += 1
    return eager_pass()


def gradient(core, vspace, target_ids, source_ids, sources_that_are_targets,
             output_gradients, retain, target_meta, eager_pass,
             all_watched=False):
    """The pass through the cache: the gradients, computed by a compiled
    function when the key allows, else by ``eager_pass()``."""
    cache = CACHE
    if (cache.mode == "off" or vspace.profile_stats is not None
            or sys.getprofile() is not None or vspace._is_recording()  # pylint: disable=protected-access
            or not context.executing_eagerly()):
        return _skipped(eager_pass)
    plan = core.plan(target_ids, source_ids, all_watched)
    if plan is None:
        return _skipped(eager_pass)
    code, entries = plan
    if not entries:
        return _skipped(eager_pass)
    signed = backward_signature(entries, CONFIG_INPUTS, config_inputs_of)
    if signed is None:
        return _skipped(eager_pass)
    signature, feeds = signed
    for meta in target_meta:
        if type(meta) is not tuple:
            return _skipped(eager_pass)
    og_sig = None
    if output_gradients is not None:
        og_sig = []
        for g in output_gradients:
            if g is None:
                og_sig.append(None)
            elif type(g) is not ops.EagerTensor:
                return _skipped(eager_pass)
            else:
                sig = (g._shape_tuple(), g._datatype_enum())  # pylint: disable=protected-access
                if sig != target_meta[len(og_sig)]:
                    # A seed that does not fit its target: TF's graph-mode
                    # gradients (static shapes) treat it unlike the eager
                    # ones, so such a pass stays eager (and fails, or not,
                    # as TF's eager pass does).
                    return _skipped(eager_pass)
                og_sig.append(sig)
        og_sig = tuple(og_sig)
    # The device scope places the call (as it places eager gradient ops);
    # the function's arguments are placed by where its feeds are.
    # Determinism is read by some gradient functions while they build ops.
    key = (code, signature, tuple(target_meta), og_sig, all_watched,
           context.context().device_name, _determinism())
    try:
        compiled = cache.compiled.get(key)
    except TypeError:       # an attr value that cannot be a key
        return _skipped(eager_pass)
    if compiled is _FAILED:
        return _skipped(eager_pass)
    if compiled is not None:
        cache.compiled.move_to_end(key)
        feeds += [g for g in output_gradients or () if g is not None]
        grads = compiled(feeds)
        if not (core.persistent or retain):
            core.release()
        cache.stats["replayed"] += 1
        return grads
    seen = cache.seen.get(key, 0) + 1
    if cache.mode == "auto" and seen < 2:
        if len(cache.seen) >= _MAX_COUNTS:
            cache.seen.clear()
        cache.seen[key] = seen
        cache.stats["eager"] += 1
        return eager_pass()
    cache.seen.pop(key, None)
    verify = cache.mode == "verify"
    # Build while the payloads are alive, then run the eager pass (which
    # may release them) and check the two agree.
    why = None
    try:
        compiled = _build(core, entries, feeds, target_ids, source_ids,
                          sources_that_are_targets, output_gradients,
                          target_meta, all_watched)
        if compiled is None:
            why = "the trace captured an eager tensor"
    except Exception as e:  # pylint: disable=broad-except
        why, compiled = f"tracing failed: {e!r}", None
    start = time.perf_counter()
    grads = eager_pass()
    eager_seconds = time.perf_counter() - start
    replayed = None
    slower = False
    if compiled is not None:
        feeds += [g for g in output_gradients or () if g is not None]
        try:
            replayed = compiled.first_call(feeds)
            if not _same(grads, replayed):
                why, compiled = "it disagrees with the eager pass", None
            elif not verify and cache.keep_faster:
                # Small passes run faster op by op than through a function
                # call: keep whichever is faster (the first call above paid
                # for instantiation, so time a second one).
                start = time.perf_counter()
                compiled(feeds)
                slower = time.perf_counter() - start >= eager_seconds
        except Exception as e:  # pylint: disable=broad-except
            why, compiled = f"it failed: {e!r}", None
    if why is not None:
        logging.vlog(1, "fasttape: backward pass not compiled: %s", why)
        if verify:
            raise AssertionError(f"fasttape: backward pass not compiled: {why}")
    with cache.lock:
        cache.compiled[key] = (_FAILED if compiled is None or slower
                               else compiled)
        while len(cache.compiled) > _MAX_ENTRIES:
            cache.compiled.popitem(last=False)
    cache.stats["slower" if slower else "built" if compiled is not None
                else "failed"] += 1
    # verify (tests): hand back the compiled result, so that parity tests
    # compare it with TF's.
    return replayed if verify else grads
