"""A memory budget for a gradient tape: Dynamic Tensor Rematerialization
(Kirisame et al., ICLR 2021) over what the tape saves, in eager mode.

Terms:
  slot     one tensor the budget knows (by TF's tensor id): the tensor while
           it is resident (held by this store), how to recompute it (its
           recipe) if it can be, its bytes, when it was last used.
  recipe   one recorded op that can be re-run exactly: op type, attrs (as the
           recorder kept them), input slots, device, number of outputs.
  holder   a recorded op's payload (EagerOp) whose ``saved`` tuple holds the
           tensor; dropping a tensor swaps it, in every holder, for its slot
           (the slot then is the marker that says how to recompute it).
  held     bytes of resident tensors that only the tape holds: a tensor the
           program still references frees nothing when the tape drops it,
           so it is neither counted nor dropped (sys.getrefcount tells);
           leaves that share one buffer (reshapes of one input, made where
           the tape records nothing) count it once.

While recording, after each op, when the resident bytes pass the budget the
store counts what it alone holds and, while that is over the budget, drops
the candidate with the lowest ``h = cost / (bytes * staleness)``: cost is
the op's own estimate plus that of re-making its dropped inputs (DTR's
evicted neighbourhood, upstream), or 0 for a tensor that gradients read
only for its shape (_budget_core._SHAPE_ONLY: they get zeros of that
shape) and that no needed recomputation reads. Only what can be
recomputed exactly is dropped: outputs of ops whose OpDef is stateless, that take and make no
resource or variant, carry no function attr and are not random; never a
watched tensor, and never a leaf (a tensor no recipe makes: a variable
read, a random op's output, a constant, what a tf.function or
custom_gradient returned). A leaf that a dropped tensor's recomputation
needs is pinned (kept) instead.

In the backward pass the budget's vspace rematerializes the dropped tensors
a gradient function reads just before calling it, re-running recipes from
what is resident (iteratively, with an explicit stack), and keeps the
recomputed tensors resident under the same budget (dropped again by score).
A tape without a budget has no store: the recorder tests one pointer.
"""

import math
import os
import re
import sys
import warnings
import weakref

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context
from tensorflow.python.eager import core
from tensorflow.python.eager import execute
from tensorflow.python.eager import record
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops

from fasttape._core import VSpace
from fasttape.gradients._graph_ops import graph_op
from fasttape.gradients._payloads import EagerOp
from fasttape.gradients._tf_vspace import _tf_zeros
from fasttape.recording._budget_core import Slot, StoreCore
from fasttape.recording._budget_core import recomputable, shape_only  # noqa: F401

ENV_VAR = "FASTTAPE_MEMORY_BUDGET"

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2,
    "g": 1000 ** 3, "gb": 1000 ** 3, "t": 1000 ** 4, "tb": 1000 ** 4,
    "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_budget(value):
    """Bytes from an int or a string such as "512MB" (SI: kB, MB, GB, TB,
    powers of 1000) or "2GiB" (IEC: KiB, MiB, GiB, TiB, powers of 1024);
    None stays None. ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"memory_budget must be a number of bytes or a size "
                         f"string such as '512MB' or '2GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"memory_budget must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if unit is not None:
            n = float(m.group(1)) * unit
            if math.isfinite(n):
                return int(n)
    raise ValueError(f"memory_budget must be a number of bytes or a size "
                     f"string such as '512MB' or '2GiB', got {value!r}")


# os.environ's own dict (read at every tape's construction: without the
# Mapping layer and the key's encoding of os.environ.get)
_ENVIRON = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENVIRON is not None else None


def default_budget():
    """The budget FASTTAPE_MEMORY_BUDGET sets for every tape (None: unset)."""
    if _ENVIRON is not None:
        raw = _ENVIRON.get(_ENV_KEY)
        if raw is None:
            return None
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return None
    try:
        return parse_budget(value)
    except ValueError as exc:
        raise ValueError(f"{ENV_VAR}: {exc}") from None


class MemoryBudgetWarning(UserWarning):
    """What a budgeted tape alone holds passed its budget by more than the
    largest saved tensor: what it holds cannot be dropped (a tensor no
    recorded op can re-make exactly, one a recomputation needs, a watched
    one, or the tensors one backward step reads at once). Given once per
    tape, at the first op that breaks the bound."""


# The user's line of the running code, (filename, lineno, function) or None:
# set by the diagnostics layer's frame finder when it is imported (this layer
# may not import it).
user_line = None


# -- which ops can be re-run exactly -----------------------------------------------

_quick_execute = execute.quick_execute

# (The rules of which ops can be re-run exactly, which saved inputs their
# gradients read for their shapes only, and what re-running one costs, are
# _budget_core's, beside the per-op path that reads them.)
_EagerTensor = ops.EagerTensor



# -- the store ------------------------------------------------------------------


# How many recomputation steps _next_use follows from a tensor to the
# gradient functions that will need it (beyond: treated as not needed).
_NEXT_DEPTH = 4
# (Backward) A tensor that a gradient function this close (in recorded ops)
# to the running one reads is dropped only where the bound needs it:
# re-made a step later, it would be alive again beside what that step
# allocates, so dropping it lowers no peak and costs a recomputation.
_IMMINENT = 3
# Hysteresis: once what the tape alone holds passes the budget, drop down to
# this fraction of it, so that the next drop comes a tenth of the budget
# later (a drop scores every candidate).
LOW_WATER = 0.9


class Store(StoreCore):
    """A tape's memory budget: its slots, recipes and counters.

    The resident tensors that can free memory are split, incrementally, into
    ``shared`` (the program may still reference them: every tensor starts
    there, as the op that made it returns it) and ``sole`` (only the tape
    held them when last checked); ``sole_bytes`` is what the budget bounds.
    After an op, nothing is scanned unless the two together pass the budget;
    then only ``shared`` is re-checked (reference counts), and the candidates
    are scored only when ``sole_bytes`` passes it."""

    def __init__(self, budget):
        self.budget = budget
        self.low = int(budget * LOW_WATER)
        self.slots = {}             # tensor id -> Slot
        self.resident = {}          # tensor id -> Slot whose tensor is held here
        self.resident_bytes = 0
        self.shared = {}            # resident, not a variable's value, maybe referenced elsewhere
        self.shared_bytes = 0
        self.sole = {}              # resident, only the tape held it when last checked
        self.sole_bytes = 0
        self._recheck_at = 0        # (many shared) bytes at which to re-check them
        self.clock = 0
        self.dropped = 0            # tensors dropped (counted each time)
        self.dropped_bytes = 0
        self.recomputed = 0         # tensors recomputed (ops re-run: recomputed_ops)
        self.recomputed_bytes = 0
        self.recomputed_ops = 0
        self.largest = 0            # bytes of the largest saved tensor seen
        self.debug = False          # measure held bytes after every step
        self.max_held = 0           # (debug) the most held bytes seen
        self.max_over = 0           # (debug) the most held bytes over budget seen
        self.passes = 0             # backward passes run with this store
        self.compiled_passes = 0    # of them, replayed as one compiled function
        self._locked = ()
        self._saved_by = {}         # payload weakref -> Slots its saved tuple names
        self._when = {}             # payload weakref -> clock when it was recorded
        self.position = None        # (backward) clock of the op whose gradient runs
        self._on_death = _death_callback(weakref.ref(self))
        self.watched = set()        # ids the program asked the tape to watch
        self._devices = {}          # a recipe's device -> its name in a device scope
        self.dropped_by_type = {}   # op type (of the dropped tensor's recipe) -> count
        self.dropped_ids = set()    # (debug) ids of every tensor dropped
        self.made_by = {}           # a leaf's tensor id -> the op type that made it
        self.warned = None          # the MemoryBudgetWarning given (once), or None
        self.over_tensor = None     # (then) the id of the tensor it named
        self.pass_key = None        # (backward) the pass's key in _PASS_WATER
        self.lowered = False        # (backward) it started below the usual level
        # A dropped tensor's id -> what recomputing it costs (_chain_cost):
        # kept from one drop to the next, forgotten where a tensor it
        # counts is dropped or made resident (_forget_chains). Recomputed
        # at every drop, the chain of a long run of dropped tensors was
        # walked again at each (a 100-layer chain under a tight budget:
        # half of its recording time).
        self._chain = {}
        self._buffers = {}
        # The drop plan: what the previous tape under this budget dropped
        # while recording (_PLANS), followed while this tape records the
        # same ops, in place of scoring (see _follow_plan).
        self._ops = []              # op type of each recorded op, by clock - 1
        self._recipes = []          # its Recipe (None: a leaf's op), by clock - 1
        self._log = []              # (recording) drops: (clock, recipe clock, output)
        # (Recipes are kept by clock only where a plan under this budget may
        # be followed; which one is looked up at the first drop decision.)
        self._keep_recipes = any(key[0] == budget for key in _PLANS)
        self._plan = _UNSEEN
        self._first_drop = 0        # (recording) clock of the first drop decision
        self._matched = 0           # ops checked equal to the plan's
        self._plan_next = 0         # the plan's next drop
        self.planned = 0            # drop decisions the plan made (no scoring)

    # -- recording ----------------------------------------------------------

    def _forget_chains(self, s):
        """s was dropped or made resident: forget the chain costs that
        counted it (its own, and those of the dropped tensors below it
        through dropped tensors: a memoized chain's tensors are all
        memoized, so the walk stops at the first one that is not)."""
        memo = self._chain
        memo.pop(s.tid, None)
        if s.readers is None:
            return
        slots = self.slots
        stack = [s.readers]
        while stack:
            for tid in stack.pop():
                if memo.pop(tid, None) is not None:
                    c = slots.get(tid)
                    if c is not None and c.readers is not None:
                        stack.append(c.readers)

    # -- dropping -----------------------------------------------------------

    def held_bytes(self):
        """Bytes of resident tensors only this tape holds (dropping them
        frees memory); counted afresh."""
        return sum(s.nbytes for s in self.resident.values() if self._sole(s))

    @staticmethod
    def _sole(s):
        # References: the slot's, one per holder's saved entry while they
        # hold the tensor itself, and getrefcount's argument.
        if s.aliased or s.view:
            return False
        return sys.getrefcount(s.tensor) <= 2 + s.refs

    def enforce(self, target=None):
        """Re-check every resident tensor, then drop candidates by DTR's score
        until what only the tape holds fits the budget (or no candidate is
        left); target: drop down to it (else the low water mark)."""
        self._recheck()
        if target is not None and target < self.low:
            if self.sole_bytes > target:
                self._drop_to(target)
        elif self.sole_bytes > self.budget:
            self._drop_to(self.low)
            if self.sole_bytes > self.budget + self.largest and self.warned is None:
                self._warn()
        if self.debug:
            self._measure()

    def _why_kept(self, s):
        """Why s, resident and held by the tape alone, was not dropped."""
        if s.recipe is None:
            made = self.made_by.get(s.tid)
            why = (f"made by {made}, which cannot be re-run exactly" if made
                   else "not made by an op the tape recorded (a constant, a "
                        "random or stateful op's output, what a function "
                        "returned): it cannot be re-made")
            if s.pinned:
                readers = sorted({self.slots[r].recipe.op_type for r in s.readers or ()
                                  if r in self.slots and self.slots[r].recipe})
                why += (f"; kept: recomputing the dropped outputs of "
                        f"{', '.join(readers) or 'an op'} needs it")
            return why
        if s.tid in self.watched:
            return "watched (tape.watch)"
        if s.tid in self._locked:
            return "read by the gradient function or recomputation running now"
        if not s.closure_ok:
            return "a tensor it is recomputed from is gone"
        return "not dropped"

    def _warn(self):
        """What the tape alone holds passed the budget by more than the
        largest saved tensor, and nothing more can be dropped: say so once,
        naming the largest tensor kept and the running op's user line."""
        held = self.held_bytes()    # (counted afresh: the rare case)
        if held <= self.budget + self.largest:
            return
        kept = [s for s in self.resident.values()
                if self._sole(s) and self._why_kept(s) != "not dropped"]
        if sum(s.nbytes for s in kept) <= self.budget + self.largest:
            # (What cannot be dropped fits: the rest is being dropped.)
            return
        s = max(kept, key=lambda x: (x.nbytes, -x.tid))
        t = s.tensor
        op = (s.recipe.op_type if s.recipe is not None
              else self.made_by.get(s.tid, "an op the tape did not record"))
        where = user_line() if user_line is not None else None
        at = (f" (at {where[0]}:{where[1]}, in {where[2]})" if where else "")
        phase = "recording" if self.position is None else "the backward pass"
        msg = (f"fasttape memory budget: the tape alone holds {held} "
               f"bytes, over its budget of {self.budget} by more than the "
               f"largest saved tensor ({self.largest} bytes), during "
               f"{phase}{at}; the largest tensor it cannot drop is the output "
               f"of {op}, shape {tuple(t.shape)} {t.dtype.name} "
               f"({s.nbytes} bytes): {self._why_kept(s)}. Raise the budget, "
               f"or let go of such tensors.")
        self.warned = MemoryBudgetWarning(msg)
        self.over_tensor = s.tid
        warnings.warn(self.warned, stacklevel=2)

    def _check_closure(self, s):
        """Can s be recomputed from what stays? Pin every leaf it needs;
        False if one is gone (nobody holds it any more)."""
        if s.closure_ok:
            return True
        stack, seen, leaves = [s], set(), []
        while stack:
            x = stack.pop()
            if x.closure_ok or x.tid in seen:
                continue
            seen.add(x.tid)
            if x.recipe is None:
                if x.tensor is None:
                    t = x.wref()
                    if t is None:
                        return False
                    leaves.append((x, t))
                else:
                    leaves.append((x, x.tensor))
                continue
            stack.extend(x.recipe.inputs)
        for x, t in leaves:
            x.pinned = True
            self._hold(x, t)
        s.closure_ok = True
        return True

    def _drop_to(self, target):
        """Drop the sole candidates with the lowest h = cost / (bytes *
        staleness) until sole_bytes <= target. The cost is the recipe's
        plus that of re-running its dropped ancestors back to what is
        resident (DTR's evicted neighbourhood, upstream): dropping the next
        tensor of a chain whose tensors are already dropped costs the chain.
        Staleness: while recording, the clock ticks since the last use
        (DTR's); in the backward pass, where the order the gradient
        functions run in is known, the ticks until the next one that reads
        the tensor will run (the pass runs the recorded ops from the last
        one back: Belady's choice, weighed by cost and bytes)."""
        if self.position is None:
            if not self._first_drop:
                self._first_drop = self.clock
                self._plan = _PLANS.get((self.budget, tuple(self._ops))) \
                    if self._keep_recipes else None
                self._matched = self.clock
                if self._plan is None:
                    self._give_up_plan()
            if self._plan is not None and self._follow_plan(target):
                return
        imminent = []   # (backward) read by the next gradient functions to run
        # (StoreCore._scored: the loop over every sole tensor, compiled.)
        scored = self._scored(self.watched, self._locked, self.position, {},
                              imminent, self._check_closure, _feeds_needed,
                              _chain_cost, self._next_use, _IMMINENT)
        # (Ties by tensor id, which is unique: the slots are never compared.)
        scored.sort()
        self._drop_scored([s for _, _, s in scored], target)
        if imminent and self.sole_bytes > self.budget + self.largest:
            # (Only where the bound needs it: in the order they are read.)
            imminent.sort(key=lambda x: -x.tid)
            self._drop_scored(imminent, self.budget + self.largest)

    def _follow_plan(self, target):
        """(Recording) Drop what the previous tape under this budget dropped
        up to this op, where it recorded the same ops (an op type per
        clock): a training step records the same program each time, and
        its drop decisions (scoring every resident tensor) were most of
        what the budget cost a step. True when that brought what the tape
        alone holds down to ``target``; False (scoring drops the rest)
        where it did not, or the ops differ (the plan is then given up for
        this tape). Any tensor the plan names is dropped only where it
        could be by score (made by a recipe, sole, neither watched nor
        locked, recomputable from what stays), so the gradients are those
        of any drop order."""
        plan_ops, events = self._plan
        clock = self.clock
        start = self._matched
        if clock > len(plan_ops) or self._ops[start:clock] != list(plan_ops[start:clock]):
            self._give_up_plan()
            return False
        self._matched = clock
        slots, sole, recipes = self.slots, self.sole, self._recipes
        watched, locked = self.watched, self._locked
        todo = []
        i = self._plan_next
        while i < len(events) and events[i][0] <= clock:
            _, made_at, k = events[i]
            i += 1
            r = recipes[made_at - 1]
            if r is None or k >= len(r.outputs):
                continue
            s = slots.get(r.outputs[k])
            if s is None or s.recipe is not r or s.tensor is None or \
                    sole.get(s.tid) is not s or s.tid in watched or \
                    s.tid in locked or not (s.closure_ok or self._check_closure(s)):
                continue
            todo.append(s)
        self._plan_next = i
        self._drop_scored(todo, target)
        if self.sole_bytes > target:
            return False
        self.planned += 1
        return True

    def _give_up_plan(self):
        # (No plan followed from here: the recipes by clock are not needed.)
        self._plan = None
        self._keep_recipes = False
        self._recipes = []

    def _drop_scored(self, candidates, target):
        for s in candidates:
            if self.sole_bytes <= target:
                break
            if s.tensor is None:
                continue
            if not self._sole(s):
                # Referenced again (through a weak reference): frees nothing.
                del self.sole[s.tid]
                self.sole_bytes -= s.nbytes
                self.shared[s.tid] = s
                self.shared_bytes += s.nbytes
                continue
            self._drop(s)

    def _next_use(self, s, position, memo, depth=0):
        """(Backward) The clock of the next gradient function to run that
        reads s: the latest-recorded of its readers not run yet (those
        recorded after position ran already), either directly (a payload
        that saves it) or through a dropped tensor recomputed from it (its
        recipe reads s; followed up to _NEXT_DEPTH such steps). 0: none."""
        got = memo.get(s.tid)
        if got is not None:
            return got
        when = self._when
        holders = s.holders
        if s.shape_holders:
            shape_holders = s.shape_holders
            holders = [r for r in holders if r not in shape_holders]
        soonest = max([w for w in map(when.get, holders)
                       if w is not None and w <= position], default=0)
        if s.readers is not None and depth < _NEXT_DEPTH:
            slots = self.slots
            for tid in s.readers:
                c = slots.get(tid)
                if c is not None and c.tensor is None and c.recipe is not None \
                        and tid != s.tid:
                    n = self._next_use(c, position, memo, depth + 1)
                    if n > soonest:
                        soonest = n
        memo[s.tid] = soonest
        return soonest

    def _measure(self):
        # (debug) What only the tape holds, counted afresh, and by how much
        # it is over the budget (the bound: by the largest saved tensor at
        # most, or the tape warned).
        held = 0
        for s in self.resident.values():
            if self._sole(s):
                held += s.nbytes
        if held > self.max_held:
            self.max_held = held
        if held - self.budget > self.max_over:
            self.max_over = held - self.budget

    # -- recomputing --------------------------------------------------------

    def _get(self, s):
        t = s.tensor
        if t is None:
            t = s.wref()
            if t is not None:
                self._hold(s, t)   # the program still holds the original
        return t

    def _has(self, s):
        return self._get(s) is not None

    def materialize(self, s):
        """The tensor of slot s, recomputed if it was dropped (re-running its
        recipe, and first those of its dropped inputs: an explicit stack, no
        recursion). Recomputed tensors stay resident under the budget."""
        self.clock += 1
        t = self._get(s)
        if t is not None:
            s.last = self.clock
            return t
        ctx = context.context()
        made = set()    # ids of what this call re-made on the way to s
        for top, stack in _inputs_first(s, self._has, _recipe_inputs):
            recipe = top.recipe
            if recipe is None:
                raise RuntimeError(
                    f"fasttape memory budget: tensor {top.tid} was dropped and "
                    f"cannot be recomputed (a leaf that nobody holds); this is "
                    f"a bug in fasttape, please report it")
            inputs = [x.tensor for x in recipe.inputs]
            outputs = _run(recipe, inputs, ctx, self._devices)
            del inputs
            self.recomputed_ops += 1
            for tid, t in zip(recipe.outputs, outputs):
                x = self.slots.get(tid)
                if x is not None and x.recipe is recipe and x.tensor is None:
                    self._hold(x, t)
                    x.last = self.clock
                    self.recomputed += 1
                    self.recomputed_bytes += x.nbytes
                    made.add(tid)
            del outputs, t
            self._let_go_of_steps(s, top, stack, made)
            if self.sole_bytes + self.shared_bytes > self.budget or self.debug:
                # What the rest of the stack reads stays; the rest may go again.
                locked = set(self._locked)
                locked.add(s.tid)
                for x in stack:
                    locked.add(x.tid)
                    for i in x.recipe.inputs:
                        locked.add(i.tid)
                self._check_locked(locked)
        t = s.tensor
        s.last = self.clock
        return t

    def _let_go_of_steps(self, s, top, stack, made):
        """After materialize re-ran top's recipe on the way to s: let go at
        once of what it re-made only as a step (the recipe's inputs, and
        its other outputs) that nothing still needs: no recipe left on the
        stack reads it, no gradient reads its values, and no dropped tensor
        that a gradient needs is re-made from it. Held until the budget
        forces a drop, such steps (a convolution's output on the way to
        its relu's) added to what the backward pass allocates, beyond what
        the tape without a budget held there."""
        recipe = top.recipe
        steps = [x for x in recipe.inputs if x.tid in made]
        steps += [self.slots[t] for t in recipe.outputs
                  if t in made and t != top.tid and t in self.slots]
        if not steps:
            return
        waiting = {i.tid for x in stack for i in x.recipe.inputs}
        locked = self._locked
        for x in steps:
            if x is s or x.tensor is None or x.valued or x.tid in waiting \
                    or x.tid in locked or _feeds_needed(x, self.slots):
                continue
            made.discard(x.tid)
            if x.payloads:
                self._drop(x)
            else:
                self._release(x)

    def _read_later(self, s):
        """(Backward) Will a gradient function still to run read the
        dropped tensor s for its values? Then a gradient that reads only
        its shape is given s itself, recomputed now and held for that
        reader, not zeros of its shape: zeros would be a second tensor as
        large alive beside the recomputation (an average pool's input, its
        relu's output, re-made for the relu's gradient next)."""
        if not s.valued or self.position is None:
            return False
        when = self._when
        position = self.position
        shape_holders = s.shape_holders or ()
        for ref in s.holders:
            if ref not in shape_holders:
                w = when.get(ref)
                if w is not None and w < position:
                    return True
        return False

    def _check_locked(self, locked):
        previous = self._locked
        self._locked = locked
        try:
            self._check()
        finally:
            self._locked = previous

    def restore(self, payload, shape_pos=(), donors=()):
        """payload's saved tuple with every dropped tensor recomputed; at
        the positions its gradient reads for their shapes only (shape_pos),
        a tensor of the dropped one's shape instead: one of ``donors`` (the
        call's output gradients) viewed in that shape, else zeros."""
        saved = list(payload.saved)
        locked = set(self._locked)
        for k, x in enumerate(saved):
            if type(x) is Slot:
                if k in shape_pos and not self._read_later(x):
                    t = self._get(x)
                    if t is None:
                        t = _standin(x, donors, saved)
                    saved[k] = t
                    continue
                previous = self._locked
                self._locked = locked
                try:
                    saved[k] = self.materialize(x)
                finally:
                    self._locked = previous
                locked.add(x.tid)
        return tuple(saved)

    def summary(self):
        """The budget's counters (tape.summary() reports them)."""
        return {
            "budget": self.budget,
            "resident_bytes": self.resident_bytes,
            "held_bytes": self.held_bytes(),
            "dropped_tensors": self.dropped,
            "dropped_bytes": self.dropped_bytes,
            "recomputed_tensors": self.recomputed,
            "recomputed_bytes": self.recomputed_bytes,
            "recomputed_ops": self.recomputed_ops,
        }


def _death_callback(store_ref):
    """The callback of the weak references to payloads: it names the store
    only weakly (a bound method would make a cycle store -> ref -> store)."""
    def died(ref):
        store = store_ref()
        if store is not None:
            store._payload_died(ref)  # pylint: disable=protected-access
    return died


def _inputs_first(root, done, inputs_of):
    """The walk every recomputation takes: the nodes under ``root`` (itself
    included) that are not ``done(node)``, each yielded after the nodes of
    ``inputs_of(node)`` it depends on. An explicit stack, no recursion (a
    chain may be far deeper than Python's recursion limit). Each node is
    yielded with the stack of the nodes still waiting for it (it is popped
    first); the consumer makes it done before it asks for the next."""
    stack = [root]
    while stack:
        top = stack[-1]
        if done(top):
            stack.pop()
            continue
        todo = [x for x in inputs_of(top) if not done(x)]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        yield top, stack


def _recipe_inputs(s):
    return () if s.recipe is None else s.recipe.inputs


def _chain_cost(s, memo):
    """What recomputing the dropped tensor s costs: its recipe and those of
    its dropped ancestors (shared ancestors counted once per path; an
    estimate). Memoized in ``memo`` (tensor id -> cost: the store's, kept
    until a tensor of the chain changes, see Store._forget_chains).

    The walk of _inputs_first, written out: this one runs for every dropped
    tensor at every drop decision (tens of thousands of times a step for an
    LSTM under a quarter of its memory), where the generator's calls cost
    a tenth of the step."""
    got = memo.get(s.tid)
    if got is not None:
        return got
    stack = [s]
    while stack:
        x = stack[-1]
        if x.tid in memo:
            stack.pop()
            continue
        cost = x.recipe.cost
        todo = None
        for i in x.recipe.inputs:
            if i.tensor is None and i.recipe is not None:
                c = memo.get(i.tid)
                if c is None:
                    if todo is None:
                        todo = [i]
                    else:
                        todo.append(i)
                else:
                    cost += c
        if todo is not None:
            stack.extend(todo)
            continue
        memo[x.tid] = cost
        stack.pop()
    return memo[s.tid]


def _feeds_needed(s, slots):
    """Will s be needed to recompute a dropped tensor that a gradient reads
    for its values? Followed through the dropped (or let go) tensors
    recomputed from s, up to _NEXT_DEPTH steps (beyond: assumed so): an
    LSTM's matmul output is needed only if one of the sigmoids of its
    gates is dropped, not because the sum and the split between them
    were let go."""
    stack = [(s, 0)]
    while stack:
        x, depth = stack.pop()
        if x.readers is None:
            continue
        for tid in x.readers:
            c = slots.get(tid)
            if c is not None and c.tensor is None and c.recipe is not None:
                if c.valued or depth >= _NEXT_DEPTH:
                    return True
                stack.append((c, depth + 1))
    return False


def _standin(s, donors=(), saved=()):
    """A tensor of the dropped tensor s's shape and dtype, on its device,
    for a gradient that reads only its shape: a view of a tensor alive
    anyway (an output gradient of the call, or a tensor it saved) with as
    many elements (a reshape shares its buffer: nothing allocated), else
    zeros: TF's own cached zeros while small (an RNN's steps read many of
    one shape), else made for the call and let go after it (zeros kept
    for the whole pass were alive where the tape without a budget had let
    go of the tensor they stand for)."""
    device = s.recipe.device
    for d in (*donors, *saved):
        if type(d) is _EagerTensor and d.dtype == s.dtype and \
                d._num_elements() == s.nelem and d.device == device:  # pylint: disable=protected-access
            if d._shape_tuple() == s.shape:  # pylint: disable=protected-access
                return d
            if not context.executing_eagerly():
                break
            with record.stop_recording():
                return array_ops.reshape(d, s.shape)
    if not context.executing_eagerly():
        with ops.init_scope():
            return _standin(s)
    with ops.device(device):
        return _tf_zeros(s.shape, s.dtype)


def _run(recipe, inputs, ctx, devices):
    """Re-run a recipe's op eagerly, on its device. Through execute.execute
    as a module attribute: an outer tape (higher order) records it; while
    nothing records (it is TF's quick_execute), straight through TF's
    C API, on the device's name as a device scope would set it (devices:
    the store's dict of them)."""
    if not context.executing_eagerly():
        # Backprop traced in a graph (a jacobian's pfor): the recorded
        # tensors are eager, and so are their recomputations.
        with ops.init_scope():
            return _run(recipe, inputs, context.context(), devices)
    if execute.execute is _quick_execute:
        device = devices.get(recipe.device)
        if device is None:
            with ops.device(recipe.device):
                device = ctx.device_name
            devices[recipe.device] = device
        try:
            return pywrap_tfe.TFE_Py_Execute(
                ctx._handle, device, recipe.op_type, inputs, recipe.attrs,  # pylint: disable=protected-access
                len(recipe.outputs))
        except core._NotOkStatusException as e:  # pylint: disable=protected-access
            raise core._status_to_exception(e) from None  # pylint: disable=protected-access
    with ops.device(recipe.device):
        return execute.execute(recipe.op_type, len(recipe.outputs), inputs,
                               recipe.attrs, ctx)


def backward_vspace(tape_state, base, recorded=True):
    """The vspace for a backward pass over a budgeted tape. recorded: the
    pass may be recorded (by an outer tape, or by this one if it still
    records: refused); False for a pass that no tape records (explain's)."""
    from fasttape.recording import _callback  # pylint: disable=import-outside-toplevel
    if recorded and any(ts is tape_state for ts in _callback.current().tapes):
        raise NotImplementedError(
            "fasttape: a tape with a memory_budget cannot compute gradients "
            "while it is still recording (a persistent tape inside its own "
            "`with` block): its recomputations would be recorded on it. Call "
            "gradient() after the block, or record the higher-order pass on "
            "another tape (without a budget) around this one.")
    store = tape_state.budget
    store.passes += 1
    if store.passes == 1 and store._log:  # pylint: disable=protected-access
        _save_plan(store)
    store.position = store.clock + 1
    # Recording is over and the program's own references to the tape's
    # tensors have mostly gone: what only the tape holds is known now.
    store.pass_key = (store.clock, store.budget, len(store.slots))
    water = _PASS_WATER.get(store.pass_key)
    store.lowered = water is not None and water[0] is not None
    store.enforce(water[0] if store.lowered else None)
    return BudgetVSpace(base, store)


# What a pass that repeats (a training step: known by the ops recorded, the
# budget and the tensors known) must start from for its compiled replay to
# fit: a compiled pass keeps its feeds (what the tape holds when it starts)
# alive for the whole call, where the eager pass lets go of each after its
# last reader, so a pass refused for holding too much starts, the next
# time, from less (more dropped, then re-made inside the function).
# A replay from a lower start is kept only where it is faster than the
# eager pass from the usual level (which re-makes less than the eager pass
# from the lower start it is otherwise timed against).
# (key) -> [bytes to start from (None: the usual level again, after the
# last attempt failed or the replay was slower), attempts, the fastest
# eager pass from the usual level (seconds)]; bounded; emptied by
# clear_caches.
_PASS_WATER = {}
_PASS_WATER_MAX = 64
_PASS_WATER_ATTEMPTS = 3


def _lower_pass_water(store, excess, held):
    """A compiled pass of this store's shape was refused, ``excess`` bytes
    over what it may hold, having started from ``held`` bytes: start the
    next such pass lower (if allowed)."""
    key = store.pass_key
    if key is None:
        return
    got = _PASS_WATER.get(key)
    attempts = 1 if got is None else got[1] + 1
    start = store.low if got is None else got[0]
    if attempts > _PASS_WATER_ATTEMPTS or start is None or start <= 0:
        # No lower, and no replay from any level tried: the pass starts
        # from the usual level again and runs eagerly (each lower start
        # made its eager pass re-make more: a convnet feeding an LSTM
        # under 25%, 9 ops re-run from the usual level, 192 from the
        # third, each step 1.3-2x slower). Attempts stop growing.
        if got is not None:
            got[0] = None
            got[1] = _PASS_WATER_ATTEMPTS + 1
        return
    target = start - excess - (store.budget >> 4)
    if target >= held:
        # The pass started below that level, by more than the excess: a
        # start lowered from the level would drop nothing more, sign the
        # same pass and find it refused for good. Lowered from what it
        # held instead.
        target = held - excess - (store.budget >> 4)
    target = max(target, 0)
    if got is None and len(_PASS_WATER) >= _PASS_WATER_MAX:
        del _PASS_WATER[next(iter(_PASS_WATER))]
    if got is None:
        _PASS_WATER[key] = [int(target), attempts, math.inf]
    else:
        got[0], got[1] = int(target), attempts


def clear_caches():
    """Forget what passes started from and the drop plans
    (fasttape.clear_caches())."""
    _PASS_WATER.clear()
    _PLANS.clear()


# The drop plans: (budget, the op types recorded before the first drop
# decision) -> (the op types a tape under it recorded, by clock; what it
# dropped while recording: (clock, the clock of the op that made the
# tensor, its output index)), the last such tape's that dropped anything
# while recording. A later tape under the same budget that records the
# same ops up to its own first drop decision follows it while it records
# the same ops (Store._follow_plan); programs that differ before it (two
# models trained in turn) keep a plan each. Integers and op type names
# only (no tensor); at most _PLANS_MAX plans and _PLANS_MAX_ITEMS items in
# all (an op counts one, a drop four: its tuple and integers); emptied by
# clear_caches.
_PLANS = {}
_PLANS_MAX = 16
_PLANS_MAX_ITEMS = 1 << 20
_UNSEEN = object()      # (Store._plan before the first drop decision)


def _plan_items(plan):
    # (Its key's op types too: at most as many as the plan's.)
    return 2 * len(plan[0]) + 4 * len(plan[1])


def _save_plan(store):
    # pylint: disable=protected-access
    ops = tuple(store._ops)
    key = (store.budget, ops[:store._first_drop])
    _PLANS.pop(key, None)
    plan = (ops, tuple(store._log))
    items = _plan_items(plan)
    if items > _PLANS_MAX_ITEMS:
        return      # (a program too long to keep a plan of)
    total = items + sum(_plan_items(p) for p in _PLANS.values())
    while _PLANS and (len(_PLANS) >= _PLANS_MAX or total > _PLANS_MAX_ITEMS):
        total -= _plan_items(_PLANS.pop(next(iter(_PLANS))))
    _PLANS[key] = plan


class BudgetVSpace(VSpace):
    """The vspace of a budgeted tape's backward pass: the recording layer's
    own (so anomaly mode and the profiler still see every call), with each
    dropped tensor a gradient function reads recomputed just before it
    runs."""

    def __init__(self, base, store):
        super().__init__(base.none_ok_indices)
        self.base = base
        self.store = store
        # A tensor's gradients summed as they arrive (where that gives the
        # bits of one sum at the end): a sequence that an RNN slices step
        # by step gets one gradient as large as it per step, all alive
        # until the last step's without this.
        self.fold_pending = True

    def num_elements(self, grad):
        return self.base.num_elements(grad)

    def element_size(self, grad):
        return self.base.element_size(grad)

    def aggregate(self, grads):
        return self.base.aggregate(grads)

    def fold(self, grads):
        for g in grads:
            if type(g) is not _EagerTensor:
                return None     # (IndexedSlices, symbolic: summed at the end)
        return self.base.aggregate(grads)

    def ones_like(self, meta):
        return self.base.ones_like(meta)

    def zeros_like(self, meta):
        return self.base.zeros_like(meta)

    def tensor_id(self, tensor):
        return self.base.tensor_id(tensor)

    def call_backward(self, op_type, payload, unneeded_indices, out_grads):
        store = self.store
        if store.reached(payload):
            # The recomputed tensors go into the payload itself for the
            # call, not into a copy: what is keyed by the payload (anomaly
            # mode's record of where the op ran) must find it. (While the
            # payload holds them, they are not the store's alone: nothing
            # drops them.)
            marked = payload.saved
            payload.saved = store.restore(
                payload, shape_only(op_type, payload.num_inputs), out_grads)
            try:
                grads = self.base.call_backward(op_type, payload,
                                                unneeded_indices, out_grads)
            finally:
                payload.saved = marked
        else:
            grads = self.base.call_backward(op_type, payload, unneeded_indices,
                                            out_grads)
        if store.sole_bytes + store.shared_bytes > store.budget or store.debug:
            store._check()  # pylint: disable=protected-access
        return grads


# A compiled pass re-runs each recipe at most about this many times (else
# it is not compiled).
_MAX_REMADE_PER_RECIPE = 4


class _Marker:
    """In a traced pass's stand-in payload, a dropped tensor: recomputed
    inside the function (n: its local number) or, where the gradient reads
    only its shape, zeros (n None; spec: shape, dtype, device)."""
    __slots__ = ("n", "spec")

    def __init__(self, n, spec=None):
        self.n = n
        self.spec = spec


class GraphRecompute:
    """One budgeted backward pass compiled with its recomputations in it
    (gradients._compiled.gradient's ``recompute``).

    While the pass is signed (``hook``), each dropped tensor a gradient
    reads is numbered with the closure that re-makes it: the recipes to
    re-run and the resident tensors they start from (``feeds``). The
    numbering is the pass's ``signature()``: two passes that drop the same
    tensors of the same structure share a function. While it is traced,
    each gradient call that reads a dropped tensor re-runs its recipes as
    graph ops made after that call's output gradients (control
    dependencies): the executor cannot recompute ahead of where the eager
    pass would."""

    def __init__(self, store):
        self.store = store
        self.feeds = []         # resident tensors recomputations start from
        self._local = {}        # slot tid -> local number
        self._desc = []         # local number -> description
        self._recipes = {}      # id(recipe) -> local recipe number
        self._recipe_desc = []
        self._recipe_objs = []
        self._at = {}           # (entry index, saved index) -> _Marker
        self._recipe_bytes = []  # local recipe number -> bytes of its outputs read
        self.n_tensors = 0      # dropped tensors its gradients read ...
        self.n_bytes = 0        # ... and their bytes
        self._fed = None        # (trace) local number -> placeholder
        self._memo = None       # (trace) recipe number -> [outputs, last step counted alive]
        self._alive = None      # (trace) per step (an op re-run, a call reading
                                # what was): recomputed bytes alive
        self._cap = 0           # (trace) what the budget leaves for them
        self._deps = None       # (trace) what the ops re-run for a call come after
        self._donors = ()       # (trace) the output gradients of that call
        self._after = []        # (trace) what the last such call returned
        self._last_op = None    # (trace) the op re-run last for this call
        self._held_at_start = store.sole_bytes  # what only the tape holds now
        self.peak = 0           # (traced) most recomputed bytes alive at once
        self.too_many = False   # (traced) it would re-run too many ops
        self.graph_ops = 0      # (traced) ops the function re-runs
        self._held = 0          # what refuse() counted: held now and the peak

    # -- signing ------------------------------------------------------------

    def hook(self, i, k, op_type, num_inputs, x, sig):
        if type(x) is not Slot or x.shape is None:
            return False
        if k in shape_only(op_type, num_inputs):
            spec = (x.shape, x.dtype, x.recipe.device if x.recipe else None)
            self._at[(i, k)] = _Marker(None, spec)
            sig.append(("zeros",) + spec)
            return True
        n = self._number(x)
        if n is None:
            return False
        self._at[(i, k)] = _Marker(n)
        sig.append(("slot", n))
        return True

    def _number(self, s):
        """The local number of slot s, numbering first what re-makes it
        (iterative, inputs before the recipe that reads them)."""
        got = self._local.get(s.tid)
        if got is not None:
            return got
        store = self.store
        for top, _ in _inputs_first(s, self._numbered, self._remade_from):
            t = store._get(top)  # pylint: disable=protected-access
            if t is not None:
                self._local[top.tid] = len(self._desc)
                self._desc.append(("fed", t._datatype_enum(), t._shape_tuple()))  # pylint: disable=protected-access
                self.feeds.append(t)
                continue
            recipe = top.recipe
            if recipe is None:
                return None
            r = self._recipes.get(id(recipe))
            if r is None:
                attrs = _hashable_attrs(recipe.attrs)
                if attrs is None:
                    return None
                r = self._recipes[id(recipe)] = len(self._recipe_desc)
                self._recipe_desc.append((
                    recipe.op_type, attrs, recipe.device, len(recipe.outputs),
                    tuple(self._local[x.tid] for x in recipe.inputs)))
                self._recipe_objs.append(recipe)
                self._recipe_bytes.append(0)
            self._local[top.tid] = len(self._desc)
            self._desc.append(("made", r, recipe.outputs.index(top.tid)))
            self._recipe_bytes[r] += top.nbytes
            self.n_tensors += 1
            self.n_bytes += top.nbytes
        return self._local[s.tid]

    def _numbered(self, s):
        return s.tid in self._local

    def _remade_from(self, s):
        """What slot s is re-made from (none for a tensor held now: it is
        fed)."""
        if s.recipe is None or self.store._get(s) is not None:  # pylint: disable=protected-access
            return ()
        return s.recipe.inputs

    def signature(self):
        return (tuple(self._desc), tuple(self._recipe_desc))

    def refuse(self, peak):
        """Why a compiled pass whose recomputations hold ``peak`` bytes at
        most may not run now (None: it may): its feeds stay alive for the
        whole call, so what the tape holds now and that peak together may
        pass the budget by no more than the largest saved tensor, the bound
        the eager pass keeps."""
        store = self.store
        held = self._held = self._held_at_start + peak
        over = held - store.budget
        if over > store.largest:
            _lower_pass_water(store, over - store.largest, self._held_at_start)
            return (f"its recomputations would hold {peak} bytes besides the "
                    f"{held - peak} the tape holds: {over} over the budget")
        return None

    def ran_eagerly(self, seconds):
        """The pass ran eagerly in ``seconds`` (timed by the compiled
        cache, that decides whether a replay is faster); returns the eager
        seconds its replay must beat: from the usual level, where this
        pass started lower."""
        store = self.store
        water = _PASS_WATER.get(store.pass_key)
        if water is None:
            return seconds
        if not store.lowered:
            water[2] = min(water[2], seconds)
            return seconds
        return min(seconds, water[2])

    def given_up(self):
        """This pass's replay was slower than the eager pass, or its
        build failed (found so in the compiled cache): a pass started
        lower for it starts from the usual level again. (Started lower
        and signed as a pass whose build failed, nothing more being
        droppable, it would run eagerly from the lower start at every
        step, re-making more than from the usual level.)"""
        water = _PASS_WATER.get(self.store.pass_key)
        if water is not None and self.store.lowered:
            water[0] = None
            water[1] = _PASS_WATER_ATTEMPTS + 1


    def replayed(self, ops_run):
        """A compiled replay ran, re-running ops_run ops: count them."""
        store = self.store
        if store.debug:
            if self._held > store.max_held:
                store.max_held = self._held
            if self._held - store.budget > store.max_over:
                store.max_over = self._held - store.budget
        store.recomputed_ops += ops_run
        store.recomputed += self.n_tensors
        store.recomputed_bytes += self.n_bytes
        store.compiled_passes += 1

    # -- tracing ------------------------------------------------------------

    def marker(self, i, k):
        return self._at[(i, k)]

    def bind(self, placeholders):
        """(trace) The placeholders of ``feeds``, in order."""
        self._fed = {}
        it = iter(placeholders)
        for n, d in enumerate(self._desc):
            if d[0] == "fed":
                self._fed[n] = next(it)
        self._memo = {}
        self._alive = []
        store = self.store
        # What recomputations may hold at once, re-running rather than
        # keeping alive beyond it (the largest saved tensor's slack, that
        # refuse() allows, is left for what one op re-made holds beyond
        # it: as the eager pass, what a call reads is not the tape's
        # while the call runs, see _extend).
        self._cap = store.budget - self._held_at_start

    def resolve(self, stand_in, out_grads):
        """stand_in with its markers replaced by graph tensors. Every op
        re-run is made after out_grads, after what the previous gradient
        call that read recomputed tensors returned (so that call has let
        go of them), and after the op re-run before it: the function runs
        its recomputations and the calls that read them in the order they
        were traced, and _alive counts what is alive at each step."""
        saved = stand_in.saved
        if not any(type(x) is _Marker for x in saved):
            return stand_in
        self._deps = _tensors(out_grads) + self._after
        self._donors = _tensors(out_grads)
        read = []
        saved = tuple(self._value(x, read) if type(x) is _Marker else x
                      for x in saved)
        # The call itself: one more step, at which what it reads is alive.
        call = len(self._alive)
        self._alive.append(0)
        for r in read:
            self._extend(r, call)
        return EagerOp(stand_in.attrs, saved, stand_in.num_inputs)

    def returned(self, grads):
        """(trace) What the call resolve() last served returned."""
        self._after = _tensors(grads)
        self._last_op = None

    def finish(self):
        """(trace) The most bytes of recomputed tensors alive at once, and
        the ops the function re-runs."""
        self.peak = max(self._alive, default=0)
        return self.peak, self.graph_ops

    def _value(self, m, read):
        if m.n is None:
            shape, dtype, device = m.spec
            n = math.prod(shape)
            for d in self._donors:
                # (As the eager pass: an output gradient of the call viewed
                # in the shape, where it has as many elements.)
                if d.dtype == dtype and d.shape.is_fully_defined() and \
                        d.shape.num_elements() == n:
                    if tuple(d.shape) == tuple(shape):
                        return d
                    with ops.device(device):
                        return array_ops.reshape(d, shape)
            # (After the call's output gradients: zeros made of nothing
            # would be constant-folded into the function's definition.)
            with ops.device(device), ops.control_dependencies(self._deps):
                return array_ops.zeros(shape, dtype)
        d = self._desc[m.n]
        if d[0] == "fed":
            return self._fed[m.n]
        self._made(d[1])
        read.append(d[1])
        return self._memo[d[1]][0][d[2]]

    def _fits(self, r, step):
        """May recipe r's outputs, made earlier, still be alive at ``step``
        (read there)? Yes while every step in between keeps within what
        the budget leaves (else r is re-run, as the eager pass re-runs what
        it dropped again)."""
        m = self._memo.get(r)
        if m is None:
            return False
        nbytes = self._recipe_bytes[r]
        alive = self._alive
        cap = self._cap
        for g in range(m[1] + 1, min(step, len(alive))):
            if alive[g] + nbytes > cap:
                return False
        return True

    def _extend(self, r, step):
        """Recipe r's outputs are read at ``step``: alive at every step
        after the last that read them, up to it. Not counted at ``step``
        itself, as the eager pass counts what the tape holds after each op
        (what a call or a re-run op reads is the op's, not the tape's,
        while it runs: the eager pass's restore() holds it in the call's
        saved tuple, where it is not the tape's alone): counted there,
        a call reading three tensors re-made one from the other was
        refused for holding them all at once, and ran eagerly for good
        (a conv net under 25%, 3x slower than unbudgeted for 2x)."""
        m = self._memo[r]
        nbytes = self._recipe_bytes[r]
        alive = self._alive
        for g in range(m[1] + 1, step):
            alive[g] += nbytes
        if step > m[1]:
            # counted through step - 1: read again later, r is the tape's
            # after this step too, and a later extension counts it here
            m[1] = step - 1

    def _made(self, top):
        """(trace) Recipe top's outputs in the graph: made earlier and still
        fitting, or re-run now from the feeds (its inputs first: an
        explicit stack)."""
        desc = self._desc

        def fits(r):
            return self._fits(r, len(self._alive))

        def made_inputs(r):
            return [desc[x][1] for x in self._recipe_desc[r][4] if desc[x][0] == "made"]

        for r, _ in _inputs_first(top, fits, made_inputs):
            if self.graph_ops >= _MAX_REMADE_PER_RECIPE * len(self._recipe_desc) + 64:
                # Re-made from too far back, too often (a long chain under
                # a tiny budget): the eager pass, which keeps what it
                # re-made under the budget's score, does fewer.
                self.too_many = True
                # (Re-made from far back for lack of room: the next such
                # pass starts from less, leaving its recomputations more.)
                _lower_pass_water(self.store, self.store.budget >> 2,
                                  self._held_at_start)
                raise RuntimeError(
                    f"a compiled pass would re-run {self.graph_ops}+ ops "
                    f"for {len(self._recipe_desc)} dropped recipes")
            step = len(self._alive)
            self._alive.append(0)
            for x in made_inputs(r):
                self._extend(x, step)
            values = [self._fed[x] if desc[x][0] == "fed"
                      else self._memo[desc[x][1]][0][desc[x][2]]
                      for x in self._recipe_desc[r][4]]
            last = self._last_op
            deps = self._deps if last is None or any(
                v.op is last for v in values) else self._deps + [last]
            outs = _ordered_graph_op(self._recipe_objs[r], values, deps)
            self._last_op = outs[0].op if outs else None
            self._memo[r] = [outs, step]
            self._alive[step] += self._recipe_bytes[r]
            self.graph_ops += 1


def _hashable_attrs(attrs):
    """attrs as a key (list values as tuples), or None."""
    try:
        hash(attrs)
        return attrs
    except TypeError:
        pass
    attrs = tuple(tuple(v) if type(v) is list else v for v in attrs)
    try:
        hash(attrs)
    except TypeError:
        return None
    return attrs


def _tensors(values):
    out = []
    for g in values:
        if g is None:
            continue
        g = getattr(g, "values", g)     # IndexedSlices
        if isinstance(g, tensor_lib.Tensor):
            out.append(g)
    return out


def _graph_op(recipe, inputs):
    """Re-make a recipe's op in the graph being traced."""
    with ops.device(recipe.device):
        return graph_op(recipe.op_type, inputs, recipe.attrs)


# Ops that TF's oneDNN graph pass (MklLayoutRewritePass, run when a
# function is instantiated) merges with the op before them (a convolution
# with its bias add, a pad with its convolution), or that it rewrites to
# its own kernels: given no control input, it merged a re-made
# convolution and bias add (other kernels than the eager pass's, and a
# cycle where the bias add was ordered after the convolution), and with
# one it aborted the process (a convolution may have its two inputs
# only). Such an op reads its first input through a reshape to its own
# shape, which carries the control dependencies and which nothing merges:
# the kernels the eager pass ran, each on its own.
_NO_CONTROL_INPUT = frozenset({
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "BiasAdd", "Pad", "PadV2",
    "MirrorPad", "MaxPool", "AvgPool", "MaxPoolV2", "AvgPool3D", "MaxPool3D",
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})


def _ordered_graph_op(recipe, inputs, deps):
    """_graph_op, made after ``deps`` (control dependencies): on the op
    itself, or for the ops of _NO_CONTROL_INPUT on a reshape of its first
    input (a view of its buffer: no copy, no arithmetic)."""
    if recipe.op_type not in _NO_CONTROL_INPUT or not inputs:
        with ops.control_dependencies(deps):
            return _graph_op(recipe, inputs)
    inputs = list(inputs)
    x = inputs[0]
    shape = (x.shape.as_list() if x.shape.is_fully_defined()
             else array_ops.shape(x))
    with ops.device(recipe.device), ops.control_dependencies(deps):
        inputs[0] = array_ops.reshape(x, shape)
    return _graph_op(recipe, inputs)
