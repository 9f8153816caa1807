# cython: language_level=3
# distutils: language = c++
"""The memory budget's per-op path, compiled (recording._budget builds the
rest on it): which ops can be re-run exactly and which saved inputs their
gradients read for their shapes only (the rules, stated here once), the
slots and recipes the budget keeps, and ``StoreCore.recorded``, called by
the recorder for every op a budgeted tape records.

Slots and recipes are extension types the garbage collector does not track
(no reference cycle passes through them: a recipe names its outputs by
tensor id, a slot its holders by weak reference), so recording under a
budget makes few objects the collector counts.
"""

import math
import weakref

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops

cimport cython
cimport numpy as cnp
from cpython.ref cimport Py_REFCNT
from libc.stdint cimport int64_t

from fasttape.gradients._payloads cimport EagerOp, tensor_enum, tensor_shape
from fasttape.gradients._tf_vspace import element_size as _element_size

cdef object _EagerTensor = ops.EagerTensor
cnp.import_array()
# Strings, resources and variants: no NumPy view of their buffers.
_NO_NUMPY = frozenset((7, 20, 21))
cdef object _weakref = weakref.ref


# -- which ops can be re-run exactly -----------------------------------------------

cdef int _DT_RESOURCE = 20
cdef int _DT_VARIANT = 21
# Stateless by their OpDef yet not to be re-run: reads of state, host-side
# effects, and anything random (seeded stateless ops too: kept out, to be
# conservative).
_NEVER = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd",
                    "VarHandleOp", "VarIsInitializedOp", "Const", "Placeholder",
                    "EagerPyFunc", "PyFunc", "PyFuncStateless", "Timestamp",
                    "Print", "PrintV2", "DebugIdentity", "DebugIdentityV2",
                    "DebugIdentityV3", "CheckNumerics", "CheckNumericsV2"})
cdef dict _recomputable_cache = {}


cpdef bint recomputable(op_type) except -1:
    """Can an op of this type be re-run to give the same values (bit for
    bit on CPU)? From its OpDef: not stateful, no resource or variant
    argument, no function attr, not random, not on the deny list."""
    ok = _recomputable_cache.get(op_type)
    if ok is None:
        ok = _recomputable(op_type)
        _recomputable_cache[op_type] = ok
    return ok


def _recomputable(op_type):
    if op_type in _NEVER or "Random" in op_type or op_type.startswith(
            ("Stateless", "Stateful")):
        return False
    op_def = op_def_registry.get(op_type)
    if op_def is None or op_def.is_stateful:
        return False
    for arg in list(op_def.input_arg) + list(op_def.output_arg):
        if arg.type in (_DT_RESOURCE, _DT_VARIANT):
            return False
    for attr in op_def.attr:
        if "func" in attr.type:
            return False
    return True


cdef bint _has_none_value(attrs) except -1:
    """Does a flat (name, value, ...) attrs tuple hold a None value?"""
    cdef Py_ssize_t j
    if type(attrs) is not tuple:
        return any([v is None for v in attrs[1::2]])
    for j in range(1, len(<tuple>attrs), 2):
        if (<tuple>attrs)[j] is None:
            return True
    return False


cdef bint _plain(list tensors) except -1:
    """Eager tensors, none a resource or variant (checked per op: a type
    attr may make them so): no recipe takes or makes these."""
    cdef int enum
    for t in tensors:
        if type(t) is not _EagerTensor:
            return False
        enum = tensor_enum(t)
        if enum == _DT_RESOURCE or enum == _DT_VARIANT:
            return False
    return True


# Inputs that an op's gradient function reads for their shapes only, never
# their values (TF's registered gradients and fasttape's fast rules for
# them): a dropped tensor such a gradient reads there is not recomputed for
# it; it gets zeros of the same shape and dtype (one per shape, dtype and
# device in a pass), and the gradient is the same bit for bit. A tensor
# that only such reads keep (a matmul's output before its bias add) costs
# nothing to drop. (ConcatV2: every input but the axis, whose value the
# gradient reads. A slice's, a reduction's, a broadcast's, a cast's, a pad's
# and an average pool's input, and a select's branches: shapes (and dtypes)
# only, in TF's gradients and the fast rules.)
_SHAPE_ONLY = {"Add": (0, 1), "AddV2": (0, 1), "Sub": (0, 1),
               "Reshape": (0,), "ExpandDims": (0,), "Squeeze": (0,),
               "ConcatV2": None,
               # (Saved positions count the inputs, then the outputs.)
               "StridedSlice": (0,), "Slice": (0, 3), "Sum": (0,),
               "Mean": (0, 2), "Tile": (0,), "BroadcastTo": (0,),
               "Cast": (0,), "AvgPool": (0,), "Pad": (0,), "PadV2": (0,),
               "SelectV2": (1, 2, 3)}


cdef object _shape_only(op_type, num_inputs):
    got = _SHAPE_ONLY.get(op_type, ())
    return range(num_inputs - 1) if got is None else got


def shape_only(op_type, num_inputs):
    """The positions of an op's saved inputs its gradient reads for their
    shapes only (empty: none)."""
    return _shape_only(op_type, num_inputs)

_INNER_DIM_OPS = frozenset(("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
                            "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv1D"))


# Costs are in elements touched (read or written by an elementwise kernel:
# about 0.3 ns each on this CPU). Re-running an op through the budget's
# Python path (rematerialize, dispatch, bookkeeping) costs about 30 us,
# what touching this many elements does: a cheap elementwise op is not free
# to re-run.
DISPATCH = 100000
# A multiply-add of a matmul or convolution (MKL/oneDNN, vectorized and
# threaded) costs about a twenty-fifth of an element touched: a 64x320 by
# 320x1024 matmul, 21M multiply-adds, runs in about 0.3 ms, some 7 times a
# 16K-element sigmoid re-run, not 340.
MACS_PER_ELEMENT = 25


@cython.wraparound(True)
def _macs(op_type, inputs, n_out):
    """A matmul's or convolution's multiply-adds (outputs times the
    contracted dimension), in elements touched. A recipe's cost estimate
    is the dispatch, the elements read and written, and these."""
    macs = 0
    if op_type in _INNER_DIM_OPS and inputs:
        shape = inputs[-1]._shape_tuple() if op_type.startswith(("Conv", "Depth")) \
            else inputs[0]._shape_tuple()  # pylint: disable=protected-access
        if shape:
            factor = max(1, math.prod(d or 1 for d in shape[:-1])
                         if op_type.startswith(("Conv", "Depth")) else shape[-1] or 1)
            macs = n_out * factor // MACS_PER_ELEMENT
    return macs


# -- slots and recipes ----------------------------------------------------------


@cython.no_gc
@cython.final
cdef class Recipe:
    """One recorded op that can be re-run: what re-running it needs."""
    cdef public object op_type
    cdef public object attrs
    cdef public list inputs         # input Slots
    cdef public list outputs        # output tensor ids (not Slots: a slot names
                                    # its recipe, and no cycle may form)
    cdef public object device
    cdef public object cost
    cdef public int64_t clock       # the store's clock when it was recorded

    def __init__(self, op_type, attrs, list inputs, device, cost):
        self.op_type = op_type
        self.attrs = attrs
        self.inputs = inputs
        self.outputs = []
        self.device = device
        self.cost = cost

    def __repr__(self):
        return f"<Recipe {self.op_type} on {self.device}>"


cdef size_t _buffer_of(t) except? 0:
    """The address of a CPU tensor's buffer (0: unknown, or elsewhere):
    TF's NumPy view of it shares it."""
    if tensor_enum(t) in _NO_NUMPY or "CPU" not in t.device:
        return 0
    try:
        a = t._numpy_internal()  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
        return 0
    if not cnp.PyArray_Check(a) or cnp.PyArray_SIZE(a) == 0 or \
            cnp.PyArray_CHKFLAGS(a, cnp.NPY_ARRAY_OWNDATA):
        # (A copy, not a view, where TF makes one: its address, freed at
        # once, could be the next copy's, so it never names a buffer.)
        return 0
    return <size_t>cnp.PyArray_DATA(a)


# Leaves smaller than this are not looked up for a buffer they share
# (_hold_c): each counts its own bytes.
cdef int64_t VIEW_MIN_BYTES = 1024


cdef dict _sizes = {}    # dtype enum -> bytes per element (_element_size's)


cdef int64_t _size_of(t) except -1:
    """_element_size(t), memoized by dtype enum (read through TF's C
    function)."""
    enum = tensor_enum(t)
    size = _sizes.get(enum)
    if size is None:
        size = _sizes[enum] = _element_size(t)
    return size


cdef int64_t _nelem(t) except -1:
    cdef int64_t n = 1
    for d in tensor_shape(t):
        n *= d
    return n


@cython.no_gc
@cython.final
cdef class Slot:
    """One tensor the budget knows. In a payload's ``saved`` tuple in place
    of a dropped tensor, it is the marker that says how to recompute it."""
    cdef public int64_t tid
    cdef public object tensor       # the tensor, while this store holds it
    cdef public object wref         # the original, while anyone holds it
    cdef public Recipe recipe       # Recipe, or None for a leaf
    cdef public int64_t nbytes
    cdef public int64_t nelem
    cdef public dict holders        # payload weakref -> occurrences of the tensor in its saved
    cdef public int64_t refs        # sum of holders' values: the tape's references to the tensor
    cdef public int64_t payloads    # live payloads that save it (the tensor or this slot)
    cdef public int64_t last        # clock of the last use
    cdef public bint pinned         # a leaf some dropped tensor's recipe needs
    cdef public bint closure_ok     # every leaf it is recomputed from is pinned
    cdef public bint aliased        # a variable's value: shares its buffer, frees nothing
    cdef public bint view           # a leaf whose buffer another resident leaf, counted, shares
    cdef public size_t buf          # (a leaf's, once held) its buffer's address (0: unknown)
    cdef public object readers      # ids of the tensors whose recipes read it (or None)
    cdef public int64_t valued      # live payloads that save it for its values, not only its shape
    cdef public object shape_holders  # (or a set) payload weakrefs that save it for its shape only
    cdef public object shape        # (once dropped) its shape and dtype: what a
    cdef public object dtype        # shape-only reader is given in its place
    cdef object __weakref__

    def __init__(self, t, Recipe recipe):
        self._fill(t, recipe)

    cdef int _fill(self, t, Recipe recipe) except -1:
        self.tid = t._id  # pylint: disable=protected-access
        self.wref = _weakref(t)
        self.recipe = recipe
        self.nelem = _nelem(t)
        self.nbytes = _size_of(t) * self.nelem
        self.holders = {}
        return 0

    def __repr__(self):
        what = self.recipe.op_type if self.recipe is not None else "leaf"
        state = "resident" if self.tensor is not None else "dropped"
        return f"<fasttape dropped-tensor slot {self.tid}: {what}, {state}>"


cdef Slot _new_slot(t, Recipe recipe):
    """Slot(t, recipe), without the call's argument parsing (a slot per
    tensor a budgeted tape records)."""
    cdef Slot s = Slot.__new__(Slot)
    s._fill(t, recipe)
    return s


# -- the store's per-op path ---------------------------------------------------

# (Backward) While the program references at most this many of the
# resident tensors, they are re-checked after every op; more (a layer that
# keeps its outputs in a list), and while recording, only after the
# resident bytes grew by a sixteenth of the budget since the last check
# (or past the budget and the largest saved tensor, where the bound needs
# it). Re-checked after every recorded op once over the budget, the
# forward activations' references were counted some sixty times a step
# on an LSTM, a third of what its drop decisions cost.
FEW = 32


cdef class StoreCore:
    """The fields of a budget's store that every recorded op touches, and
    ``recorded`` (recording._budget.Store is the rest)."""
    cdef public object budget
    cdef public dict slots              # tensor id -> Slot
    cdef public dict resident           # tensor id -> Slot whose tensor is held here
    cdef public int64_t resident_bytes
    cdef public dict shared             # resident, not a variable's value, maybe referenced elsewhere
    cdef public int64_t shared_bytes
    cdef public dict sole               # resident, only the tape held it when last checked
    cdef public int64_t sole_bytes
    cdef public int64_t clock
    cdef public int64_t largest         # bytes of the largest saved tensor seen
    cdef public bint debug              # measure held bytes after every step
    cdef public dict _saved_by          # payload weakref -> Slots its saved tuple names
    cdef public dict _when              # payload weakref -> clock when it was recorded
    cdef public object _on_death
    cdef public dict made_by            # a leaf's tensor id -> the op type that made it
    cdef public dict _chain             # a dropped tensor's id -> its recomputation's cost
    cdef public dict _buffers           # a held leaf's buffer address -> the leaves sharing it
                                        # (the first one counts its bytes)
    cdef public object position         # (backward) clock of the op whose gradient runs
    cdef public object low              # the low water mark: drops go down to it
    cdef public object _recheck_at      # (many shared) bytes at which to re-check them
    cdef public object warned           # the MemoryBudgetWarning given (once), or None
    cdef public int64_t dropped         # tensors dropped (counted each time)
    cdef public int64_t dropped_bytes
    cdef public dict dropped_by_type    # op type (of the dropped tensor's recipe) -> count
    cdef public object dropped_ids      # (debug) ids of every tensor dropped
    cdef public list _log               # (recording) drops: (clock, recipe clock, output)
    cdef public list _ops               # op type of each recorded op, by clock - 1
    cdef public list _recipes           # its Recipe (None: a leaf's op), by clock - 1
    cdef public bint _keep_recipes      # (then only: where a plan may be followed)

    def recorded(self, op_id, op_type, list inputs, list outputs, payload):
        """Called by the recorder after it recorded an op on the tape."""
        cdef dict slots = self.slots
        cdef Slot x, s
        cdef Recipe recipe
        cdef int64_t n_in, n_out, clock
        cdef Py_ssize_t k
        if type(payload) is not EagerOp:
            return
        if op_type == "ReadVariableOp":
            for t in outputs:
                self._slot(t).aliased = True
        self.clock += 1
        clock = self.clock
        self._ops.append(op_type)
        recipe = None
        if not outputs:
            pass
        elif not (recomputable(op_type) and _plain(outputs) and _plain(inputs)):
            # (A leaf: what made it is named if it is ever why the budget
            # cannot be kept.)
            for t in outputs:
                self.made_by[t._id] = op_type  # pylint: disable=protected-access
        else:
            in_slots = []
            n_in = 0
            closed = True
            for t in inputs:
                x = self._slot(t)
                if x.recipe is None:
                    if not x.pinned:
                        # A leaf a recipe reads (a variable's value, a
                        # constant, a random op's output) is kept: by the
                        # backward pass it may be gone, or the variable
                        # changed.
                        x.pinned = True
                        self._hold_c(x, t)
                elif not x.closure_ok:
                    closed = False
                n_in += x.nelem
                in_slots.append(x)
            attrs = (<EagerOp>payload).attrs
            if _has_none_value(attrs):
                # (None: the default, as the fast path passes it.)
                attrs = tuple([v for j in range(0, len(attrs), 2)
                               if attrs[j + 1] is not None
                               for v in attrs[j:j + 2]])
            recipe = Recipe(op_type, attrs, in_slots, outputs[0].device, 0)
            recipe.clock = clock
            out_ids = recipe.outputs
            n_out = 0
            for t in outputs:
                x = _new_slot(t, recipe)
                x.last = clock
                # Recomputable from what stays: its leaf inputs are pinned
                # now, and its other inputs were (Store._check_closure
                # need not walk back to the leaves at the first drop
                # decision that scores it).
                x.closure_ok = closed
                slots[x.tid] = x          # last writer wins, as in the core
                out_ids.append(x.tid)
                n_out += x.nelem
            # (The cost estimate: DISPATCH, the elements the slots counted,
            # and a matmul's or convolution's multiply-adds.)
            recipe.cost = DISPATCH + n_in + n_out + (
                _macs(op_type, inputs, n_out) if op_type in _INNER_DIM_OPS else 0)
            for x in in_slots:
                if x.readers is None:
                    x.readers = list(out_ids)
                else:
                    x.readers.extend(out_ids)
        if self._keep_recipes:
            self._recipes.append(recipe)
        ref = None
        mine = None
        shape_pos = _shape_only(op_type, (<EagerOp>payload).num_inputs)
        k = -1
        for t in (<EagerOp>payload).saved:
            k += 1
            if type(t) is not _EagerTensor:
                continue
            s = self._slot(t)
            if s.tensor is None:
                self._hold_c(s, t)
            if s.nbytes > self.largest:
                self.largest = s.nbytes
            if ref is None:
                ref = _weakref(payload, self._on_death)
                mine = []
            holders = s.holders
            n = holders.get(ref)
            if n is None:
                holders[ref] = 1
                s.payloads += 1
                if k in shape_pos:
                    if s.shape_holders is None:
                        s.shape_holders = {ref}
                    else:
                        s.shape_holders.add(ref)
                else:
                    s.valued += 1
                mine.append(s)
            else:
                holders[ref] = n + 1
                if k not in shape_pos and s.shape_holders is not None \
                        and ref in s.shape_holders:
                    # (Also read for its values by the same gradient.)
                    s.shape_holders.discard(ref)
                    s.valued += 1
            s.refs += 1
            s.last = clock
        if ref is not None:
            self._saved_by[ref] = mine
            self._when[ref] = clock
        if self.sole_bytes + self.shared_bytes > self.budget or self.debug:
            self._check()

    def _recheck(self):
        """Move the shared tensors the program no longer references to sole
        (Store._sole's test: not a variable's value nor a counted view, and
        referenced only by the slot and the payloads that save it)."""
        cdef dict shared = self.shared
        cdef dict sole = self.sole
        cdef Slot s
        cdef list moved = []
        for s in shared.values():
            if s.aliased or s.view:
                continue
            t = s.tensor
            # (t: one reference more, as getrefcount's argument.)
            if Py_REFCNT(t) <= 2 + s.refs:
                moved.append(s)
            t = None
        for s in moved:
            del shared[s.tid]
            self.shared_bytes -= s.nbytes
            sole[s.tid] = s
            self.sole_bytes += s.nbytes
        self._recheck_at = (self.sole_bytes + self.shared_bytes
                            + max(self.budget >> 4, 1))

    def _check(self):
        """After a step that left the resident bytes over the budget:
        re-check what the program references (if it may matter), and drop
        down to the low water mark when what the tape alone holds passes
        the budget."""
        budget = self.budget
        total = self.sole_bytes + self.shared_bytes
        if total > budget + self.largest or (self.sole_bytes <= budget and (
                total >= self._recheck_at or (
                    self.position is not None and len(self.shared) <= FEW))):
            # (Beyond the budget and the largest saved tensor, what the
            # program let go of since the last re-check could break the
            # bound: re-checked at every step there.)
            self._recheck()
        if self.sole_bytes > budget:
            self._drop_to(self.low)
            if self.sole_bytes > budget + self.largest and self.warned is None:
                self._warn()
        if self.debug:
            self._measure()

    def _drop(self, Slot s):
        """Let go of s: swap it for its slot in every holder's saved tuple."""
        cdef EagerOp p
        cdef Recipe recipe = s.recipe
        t = s.tensor
        s.shape = tensor_shape(t)
        s.dtype = t.dtype
        holders = s.holders
        for ref, n in holders.items():
            if not n:
                continue
            p = ref()
            if p is not None:
                p.saved = tuple([s if x is t else x for x in p.saved])
            holders[ref] = 0
        s.refs = 0
        t = None
        if self.position is None:
            self._log.append((self.clock, recipe.clock, recipe.outputs.index(s.tid)))
        self._release_c(s)
        self.dropped += 1
        self.dropped_bytes += s.nbytes
        op_type = recipe.op_type
        self.dropped_by_type[op_type] = self.dropped_by_type.get(op_type, 0) + 1
        if self.debug:
            self.dropped_ids.add(s.tid)
        return None

    def reached(self, payload):
        """(Backward) The gradient function of ``payload`` is about to run:
        the position becomes the clock its op was recorded at. True if its
        saved tuple names a dropped tensor (a Slot) to restore first."""
        if type(payload) is not EagerOp:
            return False
        position = self._when.get(_weakref(payload))
        if position is not None:
            self.position = position
        for x in (<EagerOp>payload).saved:
            if type(x) is Slot:
                return True
        return False

    def _scored(self, watched, locked, position, dict upcoming, list imminent,
                check_closure, feeds_needed, chain_cost, next_use,
                int64_t imminent_within):
        """Store._drop_to's scoring, compiled (typed reads of the slots'
        fields: it runs over every resident tensor at every drop
        decision): [(h, tid, slot)] for the sole candidates, unsorted;
        those a gradient function within ``imminent_within`` ops reads
        are appended to ``imminent`` instead (backward). The helpers are
        Store's and _budget's (see _drop_to)."""
        cdef list scored = []
        cdef dict slots = self.slots
        cdef dict chain = self._chain
        cdef Slot s, x
        cdef Recipe recipe
        cdef int64_t clock = self.clock
        cdef int64_t nbytes
        for s in list(self.sole.values()):
            # Droppable: made by a recipe, neither locked nor watched, and
            # recomputable from what stays.
            recipe = s.recipe
            if recipe is None:
                continue
            tid = s.tid
            if tid in locked or tid in watched or \
                    not (s.closure_ok or check_closure(s)):
                continue
            if s.valued or feeds_needed(s, slots):
                cost = recipe.cost
                for x in recipe.inputs:
                    if x.tensor is None and x.recipe is not None:
                        c = chain.get(x.tid)
                        cost += chain_cost(x, chain) if c is None else c
            else:
                # Only shape-only gradients read it, and no dropped tensor
                # that a gradient needs is recomputed from it: nothing
                # will re-run to make it.
                cost = 0
            if position is None:
                staleness = clock - s.last + 1
            else:
                used = next_use(s, position, upcoming)
                staleness = position - used + 1
                if used and staleness <= imminent_within:
                    imminent.append(s)
                    continue
            nbytes = s.nbytes
            scored.append((cost / ((nbytes if nbytes > 1 else 1) * staleness),
                           tid, s))
        return scored

    cdef Slot _slot(self, t):
        cdef Slot s = self.slots.get(t._id)  # pylint: disable=protected-access
        if s is None:
            s = _new_slot(t, None)
            self.slots[s.tid] = s
        return s

    def _slot_of(self, t):
        """The slot of tensor t (made, as a leaf's, if it has none)."""
        return self._slot(t)

    cdef int _hold_c(self, Slot s, t) except -1:
        cdef list group
        if s.tensor is None:
            s.tensor = t
            if self._chain and (s.readers is not None or s.tid in self._chain):
                self._forget_chains(s)
            self.resident[s.tid] = s
            self.resident_bytes += s.nbytes
            if s.aliased:
                return 0
            if s.recipe is None and s.nbytes >= VIEW_MIN_BYTES:
                # A leaf may be a view of another the tape holds (reshapes
                # of one input, made before the tape recorded them: each
                # a tensor of its own, one buffer): its bytes count once.
                # (Not looked up for a small one, a shape or an axis: the
                # look-up, a NumPy view of it, cost some 10 us a leaf in
                # the recorder, several per recorded layer; counted twice,
                # it counts less than VIEW_MIN_BYTES too many.)
                if s.buf == 0:
                    s.buf = _buffer_of(t)
                if s.buf != 0:
                    group = self._buffers.get(s.buf)
                    if group is not None:
                        group.append(s)
                        s.view = True
                        return 0
                    self._buffers[s.buf] = [s]
            self.shared[s.tid] = s
            self.shared_bytes += s.nbytes
        return 0

    def _payload_died(self, ref):
        """A payload that saved tensors died: its slots lose a holder, and
        those no payload saves any more are let go of (unless pinned).
        (A weakref callback: may run inside the garbage collector; it only
        lets go of references.)"""
        cdef Slot s
        cdef object holders
        self._when.pop(ref, None)
        mine = self._saved_by.pop(ref, None)
        if mine is None:
            return
        for s in mine:
            n = s.holders.pop(ref, 0)
            s.refs -= n
            s.payloads -= 1
            holders = s.shape_holders
            if holders is not None and ref in holders:
                (<set>holders).discard(ref)
            else:
                s.valued -= 1
            if s.payloads <= 0 and not s.pinned:
                self._release_c(s)

    def _release(self, Slot s):
        """Let go of s's tensor (the store no longer holds it)."""
        self._release_c(s)

    cdef int _release_c(self, Slot s) except -1:
        if s.tensor is None:
            return 0
        s.tensor = None
        tid = s.tid
        if self._chain and (s.readers is not None or tid in self._chain):
            self._forget_chains(s)
        del self.resident[tid]
        self.resident_bytes -= s.nbytes
        if self.shared.get(tid) is s:
            del self.shared[tid]
            self.shared_bytes -= s.nbytes
        elif self.sole.get(tid) is s:
            del self.sole[tid]
            self.sole_bytes -= s.nbytes
        if s.buf:
            self._unview(s)
        return 0

    def _unview(self, Slot s):
        """s is let go of: it leaves its buffer's group; if it counted the
        group's bytes, the next one in it does."""
        cdef list group = self._buffers.get(s.buf)
        cdef Slot first
        if group is None:
            return
        for i in range(len(group)):
            if group[i] is s:
                del group[i]
                break
        if not group:
            del self._buffers[s.buf]
        elif not s.view:
            first = group[0]
            if first.view:
                first.view = False
                self.shared[first.tid] = first
                self.shared_bytes += first.nbytes
        s.view = False

    def _hold(self, Slot s, t):
        self._hold_c(s, t)
