"""Why is a gradient None? ``GradientTape.explain`` and ``explain_none``.

TF returns None for a source the target does not reach through the tape and
says nothing more. fasttape keeps a few cheap facts that let it say why:

always (per tape push/pop, per ``tape.watch`` and per ``tf.stop_gradient``
of a tracked tensor, never per other op):
  - the tensor-id counter at each push and pop of the tape (tape enter,
    exit, ``stop_recording``), with the user's line and what did it. TF's
    EagerTensor ids come from one increasing global counter, so a target's
    id tells whether it was computed before the tape, while it recorded,
    inside ``stop_recording()`` or after the ``with`` block;
  - the counter and line at each ``tape.watch`` (a target older than the
    watch cannot have been recorded from the watched tensor);
  - each ``tf.stop_gradient`` of a tensor the tape tracks (TF runs it with
    recording stopped, so the trace never holds it): its input, its output
    and the user's line;
  - the recorded trace itself (which ops link the target to the source);
    a backward pass over the path finds the op whose gradient cuts it
    (``tf.stop_gradient``, ``tf.round``, an op registered as not
    differentiable).

only while ``explain_none(True)`` (or ``FASTTAPE_EXPLAIN_NONE=1``) when the
tape is entered, at a cost per op (see the README):
  - the lineage of every op the tape's thread runs while it records, recorded
    or not (op type, input ids, the user's line), and which tracked inputs it
    could not record through (integer or other non-differentiable dtypes);
  - conversions of tracked tensors to NumPy / Python (``.numpy()``...).

Where these facts cannot tell causes apart the explanation says so (cause
``target_not_recorded``) rather than guess.
"""

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import weakref

from tensorflow.python import pywrap_tfe

from fasttape.diagnostics import _frames
from fasttape.recording import _budget
from fasttape.recording import _callback
from fasttape.recording import _recording

_log = logging.getLogger("fasttape")

# -- cause codes ------------------------------------------------------------------

CONNECTED = "connected"                        # the gradient is not None
SOURCE_NOT_WATCHED = "source_not_watched"      # a tensor never watched
VARIABLE_NOT_TRAINABLE = "variable_not_trainable"
WATCH_ACCESSED_OFF = "watch_accessed_variables_off"
VARIABLE_NOT_READ = "variable_not_read"        # never read while the tape recorded
WATCHED_AFTER_USE = "watched_after_use"
NON_DIFFERENTIABLE_DTYPE = "non_differentiable_dtype"   # an int cast, argmax...
STOP_GRADIENT = "stop_gradient"
NOT_DIFFERENTIABLE_OP = "not_differentiable_op"   # its gradient gives None
STOP_RECORDING = "stop_recording"
TARGET_BEFORE_TAPE = "target_before_tape"
TARGET_AFTER_TAPE = "target_after_tape"        # after the with block
TARGET_OTHER_THREAD = "target_other_thread"
CONVERTED_TO_NUMPY = "converted_to_numpy"
OTHER_TAPE = "other_tape"
NOT_CONNECTED = "not_connected"
TARGET_NOT_RECORDED = "target_not_recorded"    # ambiguous without lineage
BACKWARD_RAISES = "backward_raises"
NO_GRADIENT = "no_registered_gradient"    # gradient() raises LookupError

CAUSES = (CONNECTED, SOURCE_NOT_WATCHED, VARIABLE_NOT_TRAINABLE,
          WATCH_ACCESSED_OFF, VARIABLE_NOT_READ, WATCHED_AFTER_USE,
          NON_DIFFERENTIABLE_DTYPE, STOP_GRADIENT, NOT_DIFFERENTIABLE_OP,
          STOP_RECORDING, TARGET_BEFORE_TAPE, TARGET_AFTER_TAPE,
          TARGET_OTHER_THREAD, CONVERTED_TO_NUMPY, OTHER_TAPE, NOT_CONNECTED,
          TARGET_NOT_RECORDED, BACKWARD_RAISES, NO_GRADIENT)

# Ops noted per tape in lineage mode, at most (then explanations say the
# lineage was cut short).
LINEAGE_LIMIT = 500_000
# Pushes and pops (and watches) kept per tape, at most: a persistent tape
# entered or paused in a long loop keeps the first ones, and tensors made
# after the last one kept are placed nowhere (no cause drawn from them).
EVENT_LIMIT = 100_000


@dataclasses.dataclass(frozen=True, eq=False)
class Explanation:
    """Why one source's gradient is (or is not) None.

    source: the source as given; cause: one of the codes in CAUSES; message:
    what happened and what to do; op_type / op_name / line: the op and the
    user's line (``file:line``) involved, where known; certain: False when
    the facts kept cannot tell this cause from others (the message lists
    them)."""
    source: object
    cause: str
    message: str
    op_type: str = None
    op_name: str = None
    line: str = None
    certain: bool = True

    def __post_init__(self):
        if self.line is not None:   # a _frames.Where, formatted now
            object.__setattr__(self, "line", str(self.line))

    def __str__(self):
        return f"{_name(self.source)}: {self.message} [{self.cause}]"

    __repr__ = __str__


Explanation.__module__ = "fasttape"   # its public name: fasttape.Explanation

# -- switching lineage on and off --------------------------------------------------

_enabled = os.environ.get("FASTTAPE_EXPLAIN_NONE", "") not in ("", "0")
_hooks_on = False
_is_trainable = None   # fasttape._callback.is_trainable, set with the hooks


def enabled():
    """Is explain_none on?"""
    return _enabled


def explain_none(flag=True):
    """Log (logger "fasttape", WARNING) why, whenever GradientTape.gradient
    returns None for a source, and keep the per-op lineage that tells causes
    apart, for tapes entered from now on. Returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    _set_hooks(_enabled)
    return previous


def take_hooks_out():
    """_recording.uninstall(): the hooks go; the next tape pushed while
    explain_none is on puts them back."""
    _set_hooks(False)


def _set_hooks(on):
    global _hooks_on, _is_trainable
    if on == _hooks_on:
        return
    _is_trainable = _callback.is_trainable
    _callback.set_lineage_hook(_lineage_hook if on else None)
    _recording.set_conversion_hook(_conversion_hook if on else None)
    _hooks_on = on


# -- facts kept per tape -------------------------------------------------------------

class _Info:
    __slots__ = ("events", "watches", "stops", "stop_roots", "lineage",
                 "conversions", "truncated", "thread")

    def __init__(self, lineage):
        self.events = []        # (id counter, pushed?, line, what did it)
        self.watches = {}       # tensor id -> (id counter, line), first watch
        # StopGradient output id -> (input id, line, the ids the tape
        # watched that the input was recorded from; None: too far to tell)
        self.stops = {}
        self.stop_roots = {}    # their input ids -> those watched ids
        self.lineage = {} if lineage else None   # output id -> _Lin
        self.conversions = []   # (id counter, tensor id, line)
        self.truncated = False
        self.thread = threading.current_thread().name


_TAPES = weakref.WeakSet()   # TapeStates with facts kept (for OTHER_TAPE)


def _info(tape_state):
    info = tape_state.explain_info
    if info is None:
        info = tape_state.explain_info = _Info(_enabled)
        _TAPES.add(tape_state)
    return info


# The counter TF draws EagerTensor ids from (ops.uid(), without its Python layer).
_uid = pywrap_tfe.TFE_Py_UID


def note_event(tape_state, pushed):
    """A push (tape enter, resume) or pop (exit, stop_recording) of a tape."""
    if _enabled and not _hooks_on:
        _set_hooks(True)   # FASTTAPE_EXPLAIN_NONE=1: from the first tape on
    events = _info(tape_state).events
    if len(events) < EVENT_LIMIT:
        line, what = _caller()
        events.append((_uid(), pushed, line, what))


def note_watch(tape_state, tensor_id):
    """tape.watch of a tensor or variable handle (id)."""
    watches = _info(tape_state).watches
    if tensor_id not in watches and len(watches) < EVENT_LIMIT:
        watches[tensor_id] = (_uid(), _caller()[0])


# Recorded ops walked back from a stop_gradient's input to find the watched
# tensors it comes from, at most (the ops themselves may be forgotten by the
# time explain() runs: an output that dies unused takes its op with it); the
# walk stops at the input of an earlier stop_gradient, whose roots are known.
STOP_WALK_LIMIT = 2_000


def note_stop_gradient(tape_state, input_id, output_id):
    """tf.stop_gradient of a tensor the tape tracks (the recorder's hook)."""
    info = _info(tape_state)
    if len(info.stops) < EVENT_LIMIT:
        roots = info.stop_roots.get(input_id, False)
        if roots is False:
            roots = info.stop_roots[input_id] = tape_state.core.watched_roots(
                input_id, STOP_WALK_LIMIT, info.stop_roots)
        info.stops[output_id] = (input_id, _caller()[0], roots)


# -- the user's line -------------------------------------------------------------------

def _caller():
    """(the innermost user frame's Where, the name of the outermost
    fasttape function below it)."""
    try:
        f = sys._getframe(2)  # pylint: disable=protected-access
    except ValueError:
        return None, None
    return _frames.caller(f)


# -- lineage (explain_none on) --------------------------------------------------------

class _Lin:
    """One op the tape's thread ran while the tape recorded."""
    __slots__ = ("op_type", "inputs", "line", "recorded", "cut_inputs",
                 "stopped")

    def __init__(self, op_type, inputs, line, recorded, cut_inputs, stopped):
        self.op_type = op_type
        self.inputs = inputs          # input ids
        self.line = line
        self.recorded = recorded
        self.cut_inputs = cut_inputs  # tracked inputs of a non-differentiable dtype
        self.stopped = stopped        # ran under record.stop_recording()


class _Busy(threading.local):
    active = False   # explain() runs a backward pass: its ops are not noted


_busy = _Busy()


def _lineage_hook(tapes, op_type, inputs, outputs, stopped=False):
    if _busy.active:
        return
    in_ids = out_ids = line = None
    for ts in tapes:
        info = ts.explain_info
        if info is None or info.lineage is None:
            continue
        lineage = info.lineage
        if len(lineage) >= LINEAGE_LIMIT:
            info.truncated = True
            continue
        if in_ids is None:
            in_ids = tuple([t._id for t in inputs])   # pylint: disable=protected-access
            out_ids = [t._id for t in outputs]        # pylint: disable=protected-access
            line = _caller()[0]
        core = ts.core
        recorded = not stopped and core.is_watched(out_ids[0])
        cut = () if recorded or stopped else tuple([
            i for i, t in zip(in_ids, inputs)
            if core.is_watched(i) and not _is_trainable(t)])
        entry = _Lin(op_type, in_ids, line, recorded, cut, stopped)
        for o in out_ids:
            lineage[o] = entry


def _conversion_hook(tensor):
    tapes = _callback.current().tapes
    if not tapes:
        return
    tid = tensor._id  # pylint: disable=protected-access
    for ts in tapes:
        info = ts.explain_info
        if info is not None and info.lineage is not None \
                and len(info.conversions) < LINEAGE_LIMIT \
                and ts.core.is_watched(tid):
            info.conversions.append((_uid(), tid, _caller()[0]))


# -- the analysis ----------------------------------------------------------------------

def _var_name(v):
    return getattr(v, "path", None) or getattr(v, "name", None)


def _name(x):
    name = _var_name(x)
    if hasattr(x, "handle") and name:
        return f"Variable {name!r}"
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if dtype is not None:
        return f"tensor <{getattr(dtype, 'name', dtype)}{list(shape) if shape is not None and shape.rank is not None else ''}>"
    return repr(x)


def _at(raw, cause, message, op, certain=True):
    """An explanation located at a lineage entry (its op type and line)."""
    return Explanation(raw, cause, message, op_type=op.op_type, line=op.line,
                       certain=certain)


def _stop_gradient(raw, op_type, line, certain=True):
    return Explanation(
        raw, STOP_GRADIENT,
        f"the path is cut by tf.stop_gradient ({op_type} at {line}): nothing "
        "flows back through it; remove it if the gradient should pass",
        op_type=op_type, line=line, certain=certain)


def explain(tape_state, target, sources):
    """Per source (a nest like ``sources``), an Explanation."""
    from tensorflow.python.eager import backprop  # pylint: disable=import-outside-toplevel
    from tensorflow.python.util import nest  # pylint: disable=import-outside-toplevel
    handle = backprop._handle_or_self  # pylint: disable=protected-access
    targets = [handle(t) for t in nest.flatten(target)]
    raw = nest.flatten(sources)
    with _quiet():
        analysis = _Analysis(tape_state, targets)
        out = [analysis.explain(s, handle(s)) for s in raw]
    return nest.pack_sequence_as(sources, out)


@contextlib.contextmanager
def _quiet():
    """A backward pass run to explain is recorded by no tape nor noted."""
    from tensorflow.python.eager import record  # pylint: disable=import-outside-toplevel
    was, _busy.active = _busy.active, True
    try:
        with record.stop_recording():
            yield
    finally:
        _busy.active = was


def log_nones(tape_state, targets, sources_raw, grads):
    """gradient()'s hook while explain_none is on: log each None."""
    if len(sources_raw) != len(grads) or all(g is not None for g in grads):
        return
    from tensorflow.python.eager import backprop  # pylint: disable=import-outside-toplevel
    handle = backprop._handle_or_self  # pylint: disable=protected-access
    with _quiet():
        analysis = _Analysis(tape_state, targets)
        for s, g in zip(sources_raw, grads):
            if g is None:
                try:
                    # A string: a kept log record must not keep the source.
                    _log.warning("gradient is None for %s",
                                 str(analysis.explain(s, handle(s))))
                except Exception as exc:  # noqa: BLE001 - never break gradient()
                    _log.warning("gradient is None for %s (explanation "
                                 "failed: %r)", _name(s), exc)


class _Analysis:
    """The trace of one tape, read once, explained for any number of sources."""

    def __init__(self, tape_state, targets):
        self.ts = tape_state
        self.core = tape_state.core
        info = tape_state.explain_info
        self.info = info if info is not None else _Info(False)
        self.targets = targets
        self.target_ids = [t._id for t in targets]  # pylint: disable=protected-access
        trace = self.core.export_trace()
        types = trace["op_types"]
        ins, outs = trace["input_ids"].tolist(), trace["output_ids"].tolist()
        in_off = trace["input_offsets"].tolist()
        out_off = trace["output_offsets"].tolist()
        self.op_ids = trace["op_ids"].tolist()
        self.op_type = [types[t] for t in trace["op_type_index"].tolist()]
        self.op_in = [ins[in_off[k]:in_off[k + 1]] for k in range(len(in_off) - 1)]
        self.op_out = [outs[out_off[k]:out_off[k + 1]]
                       for k in range(len(out_off) - 1)]
        self.producer = {}
        for k, o in enumerate(self.op_out):
            for tid in o:
                self.producer[tid] = k
        # Tensors and ops reachable backward from the targets, recorded only.
        self.anc, self.anc_ops, _, self.leaves = self._walk(
            self.target_ids, lineage=False)

    def _walk(self, start, lineage):
        """Backward from ``start``: (tensor ids, recorded op positions,
        parent: tensor id -> (op key, child id), leaves). An op key is
        ("rec", position) or ("lin", _Lin)."""
        seen, ops, parent, leaves = set(start), set(), {}, []
        stack = list(start)
        lin = self.info.lineage if lineage else None
        while stack:
            t = stack.pop()
            k = self.producer.get(t)
            if k is not None:
                if k in ops:
                    continue
                ops.add(k)
                key, inputs = ("rec", k), self.op_in[k]
            elif lin is not None and t in lin:
                e = lin[t]
                key, inputs = ("lin", e), e.inputs
            else:
                leaves.append(t)
                continue
            for i in inputs:
                if i not in seen:
                    seen.add(i)
                    parent[i] = (key, t)
                    stack.append(i)
        return seen, ops, parent, leaves

    def _descendants(self, sid):
        """Tensor ids this tape recorded from ``sid`` (and ``sid``)."""
        desc = {sid}
        for k in range(len(self.op_in)):
            if any(i in desc for i in self.op_in[k]):
                desc.update(self.op_out[k])
        lin = self.info.lineage
        for o in sorted(lin or ()):   # recorded ops the trace has forgotten
            e = lin[o]
            if e.recorded and any(i in desc for i in e.inputs):
                desc.add(o)
        return desc

    def _producer_of(self, tensor_id):
        """(op type, line) of a tensor's producer, as far as known."""
        k = self.producer.get(tensor_id)
        lin = self.info.lineage
        e = lin.get(tensor_id) if lin is not None else None
        if k is not None:
            return self.op_type[k], e.line if e is not None else None
        if e is not None:
            return e.op_type, e.line
        return None, None

    def _line_of(self, tensor_id):
        lin = self.info.lineage
        e = lin.get(tensor_id) if lin is not None else None
        return e.line if e is not None else None

    def _enter_line(self):
        ev = self.info.events
        return ev[0][2] if ev else None

    def explain(self, raw, source):
        sid = source._id  # pylint: disable=protected-access
        if sid in self.target_ids:
            return Explanation(raw, CONNECTED,
                               "the source is also a target: its gradient "
                               "includes ones")
        if not hasattr(raw, "handle") and not _callback.is_trainable(source):
            watch = self.info.watches.get(sid)
            line = watch[1] if watch is not None else None
            return Explanation(
                raw, NON_DIFFERENTIABLE_DTYPE,
                f"the source itself has dtype {source.dtype.name}"
                f"{f' (watched at {line})' if line else ''}: gradients do not "
                "flow to integer or boolean tensors (tape.watch accepts one "
                "with a warning; its gradient is always None). Watch a "
                "floating-point "
                "tensor instead: x = tf.cast(x, tf.float32), then "
                "tape.watch(x)", line=line)
        if not self.core.is_watched(sid):
            other = self._other_tape(raw, sid)
            if other is not None:
                return other
            for t in self.target_ids:   # the root cause, if so
                if not self.core.is_watched(t):
                    out = self._outside(raw, t, "target")
                    if out is not None:
                        return out
            return self._unwatched(raw)
        if sid in self.anc:
            return self._on_trace(raw, sid)
        return self._broken(raw, sid)

    # -- the source is not tracked by this tape -----------------------------

    def _other_tape(self, raw, sid):
        """Another live tape recorded, from the source, a tensor the target
        is computed from."""
        ancestors = None
        for other in list(_TAPES):
            if other is self.ts or other.core.consumed \
                    or not other.core.is_watched(sid):
                continue
            if ancestors is None:
                ancestors = self._walk(self.target_ids,
                                       lineage=self.info.lineage is not None)[0]
            theirs = _Analysis(other, [])
            shared = theirs._descendants(sid) & ancestors
            if not shared:
                continue
            events = other.explain_info.events
            line = events[0][2] if events else None
            via, via_line = theirs._producer_of(max(shared))
            return Explanation(
                raw, OTHER_TAPE,
                "the source reaches the target only through ops recorded on "
                f"another tape (entered at {line}; it recorded "
                f"{via or 'a tensor'} the target is computed from), and this "
                "tape does not track the source. Compute the target inside "
                "one tape that sees the whole path (nest the tapes, or use "
                "one tape for both)", op_type=via, line=line)
        return None

    def _unwatched(self, raw):
        enter = self._enter_line()
        if hasattr(raw, "handle"):
            if not getattr(raw, "trainable", True):
                return Explanation(
                    raw, VARIABLE_NOT_TRAINABLE,
                    "the Variable has trainable=False (a frozen Keras layer "
                    "or weight): tapes watch only trainable variables. Call "
                    "tape.watch(v) inside the tape, or make it trainable",
                    op_name=_var_name(raw), line=enter)
            if not self.ts.watch_accessed_variables:
                return Explanation(
                    raw, WATCH_ACCESSED_OFF,
                    "the tape was made with watch_accessed_variables=False "
                    f"(entered at {enter}) and the Variable was never "
                    "watched: call tape.watch(v) before using it",
                    op_name=_var_name(raw), line=enter)
            for inp, line, _ in self.info.stops.values():
                if inp == raw.handle._id:  # pylint: disable=protected-access
                    return _stop_gradient(raw, "StopGradient", line)
            return Explanation(
                raw, VARIABLE_NOT_READ,
                "the Variable was never read on the tape's thread while the "
                f"tape (entered at {enter}) recorded: it is not used to "
                "compute the target there (read before the `with` block, on "
                "another thread, or not at all)",
                op_name=_var_name(raw), line=enter)
        used = self._readers(raw._id)  # pylint: disable=protected-access
        if used:
            e = used[0]
            return Explanation(
                raw, SOURCE_NOT_WATCHED,
                f"the tensor was never watched (it is a constant or was made "
                f"outside the tape), so {e.op_type} at {e.line} that read it "
                "was not recorded: call tape.watch(x) inside the tape before "
                "using it", op_type=e.op_type, line=e.line)
        return Explanation(
            raw, SOURCE_NOT_WATCHED,
            "the tensor was never watched (a tf.constant, or a tensor made "
            f"outside the tape entered at {enter}): tapes track only "
            "trainable Variables by themselves. Call tape.watch(x) inside "
            "the tape before using it", line=enter)

    def _readers(self, tid):
        lin = self.info.lineage
        if not lin:
            return []
        seen, out = set(), []
        for e in lin.values():
            if tid in e.inputs and id(e) not in seen:
                seen.add(id(e))
                out.append(e)
        return out

    # -- a recorded path exists: which op's gradient cuts it ----------------

    def _on_trace(self, raw, sid):
        on_path, desc = self.core.path(self.target_ids, [sid])
        position = {op_id: k for k, op_id in enumerate(self.op_ids)}
        path_ops = [position[op_id] for op_id in on_path]
        path = sorted(desc & self.anc)
        from fasttape.recording._callback import output_meta  # pylint: disable=import-outside-toplevel
        from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
        tmap = {t._id: t for t in self.targets}  # pylint: disable=protected-access
        vspace = _recording.VSPACE
        if self.ts.budget is not None:
            # A memory-budgeted tape: recompute the dropped tensors the
            # pass reads (it runs under _quiet: no tape records it).
            vspace = _budget.backward_vspace(self.ts, vspace, recorded=False)
        try:
            grads = self.core.compute_gradient(
                vspace, self.target_ids, path,
                {i: output_meta(tmap[i]) for i in path if i in tmap},
                None, True, True, [output_meta(t) for t in self.targets])
        except LookupError as exc:
            for k in path_ops:
                try:
                    ops._gradient_registry.lookup(self.op_type[k])  # pylint: disable=protected-access
                except LookupError:
                    op_type = self.op_type[k]
                    line = self._line_of(self.op_out[k][0])
                    return Explanation(
                        raw, NO_GRADIENT,
                        f"{op_type} (at {line}) on the path has no registered "
                        "gradient: gradient() raises LookupError here (as "
                        "TF's tape does) rather than give None. Register one "
                        "(tf.RegisterGradient), or wrap the op in "
                        "tf.custom_gradient", op_type=op_type, line=line)
            return Explanation(
                raw, BACKWARD_RAISES,
                f"the backward pass over the path raises LookupError: {exc}",
                certain=False)
        except Exception as exc:  # noqa: BLE001 - reported
            return Explanation(
                raw, BACKWARD_RAISES,
                f"the backward pass over the path raises {type(exc).__name__}: "
                f"{exc}", certain=False)
        g = dict(zip(path, grads))
        if g.get(sid) is not None:
            return Explanation(raw, CONNECTED,
                               "the gradient is not None: the target is "
                               "recorded from the source")
        for k in reversed(path_ops):
            outs = [o for o in self.op_out[k] if o in g]
            ins = [i for i in self.op_in[k] if i in desc]
            if any(g[o] is not None for o in outs) and \
                    all(g.get(i) is None for i in ins):
                return self._cut(raw, k)
        return Explanation(
            raw, NOT_DIFFERENTIABLE_OP,
            "the target is recorded from the source, but the gradient "
            "functions on the path give None (no single op found)",
            certain=False)

    def _cut(self, raw, k):
        from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel
        op_type = self.op_type[k]
        line = self._line_of(self.op_out[k][0])
        at = f" at {line}" if line else ""
        if op_type in ("StopGradient", "PreventGradient"):
            return _stop_gradient(raw, op_type, line)
        payload = self.core.op(self.op_ids[k]).payload
        if type(payload).__name__ == "PyBackward":
            why = ("it was recorded with its own backward function (a "
                   "tf.function call, tf.custom_gradient), which gives None "
                   "for the input on the path: the cut is inside it (explain "
                   "a tape inside the function, or run it eagerly with "
                   "tf.config.run_functions_eagerly(True))")
        elif ops._gradient_registry.lookup(op_type) is None:  # pylint: disable=protected-access
            why = "it is registered as not differentiable"
        else:
            why = ("its gradient function gives None for the input on the "
                   "path (its derivative is zero or undefined almost "
                   "everywhere, e.g. round, floor, sign)")
        return Explanation(
            raw, NOT_DIFFERENTIABLE_OP,
            f"the path is cut by {op_type}{at}: {why}; use a differentiable "
            "stand-in (a straight-through estimator, a soft version)",
            op_type=op_type, line=line)

    # -- no recorded path ----------------------------------------------------

    def _when(self, tid):
        """Where a tensor id falls among the tape's pushes and pops:
        ("before"|"recording"|"paused"|"after", the event before, after)."""
        ev = self.info.events
        if not ev or tid < ev[0][0]:
            return "before", None, ev[0] if ev else None
        for i in range(1, len(ev)):
            if ev[i][0] > tid:
                prev = ev[i - 1]
                return ("recording" if prev[1] else "paused"), prev, ev[i]
        last = ev[-1]
        if len(ev) >= EVENT_LIMIT:
            return "unknown", last, None   # events past the limit not kept
        return ("recording" if last[1] else "after"), last, None

    def _outside(self, raw, tid, what):
        """An explanation for a tensor computed while the tape was not
        recording, or None if it was."""
        when, prev, nxt = self._when(tid)
        if when == "before" and nxt is not None:
            return Explanation(
                raw, TARGET_BEFORE_TAPE,
                f"the {what} was computed before the tape was entered (at "
                f"{nxt[2]}): compute it inside the `with` block",
                line=nxt[2])
        if when == "paused" and prev[3] == "stop_recording":
            return Explanation(
                raw, STOP_RECORDING,
                f"the {what} was computed inside tape.stop_recording() (at "
                f"{prev[2]}): nothing there is recorded; compute it outside "
                "that block", line=prev[2])
        if when in ("paused", "after"):
            return Explanation(
                raw, TARGET_AFTER_TAPE,
                f"the {what} was computed after the tape stopped recording "
                f"(its `with` block ended at {prev[2]}): compute it inside "
                "the `with` block", line=prev[2])
        return None

    def _broken(self, raw, sid):
        lin = self.info.lineage
        untracked = [t for t in self.target_ids if not self.core.is_watched(t)]
        watch = self.info.watches.get(sid)
        if lin is None:
            for t in untracked:
                out = self._outside(raw, t, "target")
                if out is not None:
                    return out
            if untracked and watch is not None and \
                    max(untracked) < watch[0]:
                return Explanation(
                    raw, WATCHED_AFTER_USE,
                    f"the source was watched (at {watch[1]}) after the target "
                    "was computed: ops that used it before the watch were not "
                    "recorded; call tape.watch first", line=watch[1])
            stopped = self._stopped(raw, sid, untracked)
            if stopped is not None:
                return stopped
            if untracked:
                where = ("was computed while the tape recorded, but not"
                         if self._when(untracked[0])[0] == "recording" else
                         "is not recorded (when it was computed is not known: "
                         "the tape was pushed and popped more than "
                         f"{EVENT_LIMIT} times), and was not computed")
                return Explanation(
                    raw, TARGET_NOT_RECORDED,
                    f"the target {where} "
                    "from anything the tape tracks. Without lineage the tape "
                    "cannot tell why: a conversion to NumPy/Python in the "
                    "middle (.numpy(), float()), a step through an integer "
                    "dtype (tf.cast to int, argmax), computation on another "
                    "thread, or a source watched after its use. Turn on "
                    "fasttape.explain_none(True) (or FASTTAPE_EXPLAIN_NONE=1) "
                    "before entering the tape to tell these apart",
                    certain=False)
            return Explanation(
                raw, NOT_CONNECTED,
                "the target is recorded, but not from the source: no recorded "
                "op links them (turn on fasttape.explain_none(True) before "
                "entering the tape to see the ops that were not recorded)",
                certain=False)
        seen, _, parent, leaves = self._walk(self.target_ids, lineage=True)
        if sid in seen:
            return self._unrecorded_step(raw, sid, parent, watch)
        for t in untracked:
            out = self._outside(raw, t, "target")
            if out is not None:
                return out
            if t not in lin and not self.info.truncated \
                    and self._when(t)[0] == "recording":
                converted = self._converted(raw, sid, t, None)
                if converted is not None:
                    return converted
                return Explanation(
                    raw, TARGET_OTHER_THREAD,
                    f"the target was not computed by any op on the tape's "
                    f"thread ({self.info.thread}) while it recorded: it was "
                    "computed on another thread (a tape records only the ops "
                    "of the thread that entered it; use a tape inside that "
                    "thread), or made directly from a Python/NumPy value",
                    certain=False)
        return self._leaves(raw, sid, leaves, parent)

    def _stopped(self, raw, sid, untracked):
        """Without lineage: a noted tf.stop_gradient of a tensor recorded
        from the source, whose output the target is computed from: through
        recorded ops, or through ops not recorded that ran after it while
        the tape recorded (the target, or a tensor a recorded op on the way
        read, was not recorded from anything tracked, and was computed after
        the stop_gradient cut the source's path)."""
        stops = self.info.stops
        if not stops:
            return None
        desc = self._descendants(sid)
        cut = [(out, line, roots is not None or inp in desc)
               for out, (inp, line, roots) in stops.items()
               if inp in desc or roots is None or sid in roots]
        for out, line, known in cut:
            if out in self.anc:
                return _stop_gradient(raw, "StopGradient", line, known)
        unrecorded = set(untracked) | {
            t for t in self.leaves if not self.core.is_watched(t)}
        for out, line, known in sorted(cut, reverse=True):
            if self._when(out)[0] == "recording" and any(
                    t >= out and self._when(t)[0] == "recording"
                    for t in unrecorded):
                return _stop_gradient(raw, "StopGradient", line, known)
        return None

    def _unrecorded_step(self, raw, sid, parent, watch):
        """The source reaches the target through ops not recorded: name the
        first one on the way."""
        t = sid
        while t in parent:
            (kind, op), child = parent[t]
            if kind == "lin" and not op.recorded:
                if op.stopped:
                    if op.op_type == "StopGradient":
                        return _stop_gradient(raw, op.op_type, op.line)
                    return _at(
                        raw, STOP_RECORDING,
                        f"the path is cut by {op.op_type} (at {op.line}), run "
                        "while recording was stopped (record.stop_recording)",
                        op)
                if t in op.cut_inputs:
                    src, src_line = self._producer_of(t)
                    made = (f"{src} (at {src_line}) gives an integer or "
                            "boolean tensor" if src is not None else
                            "a tensor the tape tracks is integer or boolean")
                    return Explanation(
                        raw, NON_DIFFERENTIABLE_DTYPE,
                        f"the path passes through a non-differentiable dtype: "
                        f"{made}, and {op.op_type} (at {op.line}) computes on "
                        "from it; gradients do not flow through integers. "
                        "Keep the path in floating point (a soft version, or "
                        "a straight-through estimator)",
                        op_type=src, line=src_line)
                if t == sid and watch is not None:
                    return _at(
                        raw, WATCHED_AFTER_USE,
                        f"the source was watched (at {watch[1]}) after "
                        f"{op.op_type} (at {op.line}) used it: that op was not "
                        "recorded; call tape.watch before using the tensor",
                        op)
                return _at(
                    raw, NOT_CONNECTED,
                    f"{op.op_type} (at {op.line}) read a tensor the tape "
                    "tracks but was not recorded", op, certain=False)
            t = child
        return Explanation(raw, NOT_CONNECTED, "no recorded op links the "
                           "target to the source", certain=False)

    def _converted(self, raw, sid, tid, reader, desc=None):
        """A conversion to NumPy/Python of a tensor recorded from the source,
        before tensor ``tid`` (made from no op on this thread) appeared."""
        if desc is None:
            desc = self._descendants(sid)
        for uid, converted, line in self.info.conversions:
            if uid < tid and converted in desc:
                src = self._producer_of(converted)[0] or "a tracked op"
                read = (f", read by {reader.op_type} at {reader.line}"
                        if reader is not None else "")
                return Explanation(
                    raw, CONVERTED_TO_NUMPY,
                    f"the path is cut by a conversion to NumPy/Python at "
                    f"{line} (of the output of {src}): the tape sees the value "
                    f"come back as a new constant{read}. Keep the computation "
                    "in TensorFlow ops",
                    op_type=reader.op_type if reader is not None else None,
                    line=line)
        return None

    def _leaves(self, raw, sid, leaves, parent):
        """No op links the target to the source: look for the cut among the
        tensors the target's ops start from."""
        desc = self._descendants(sid)
        for leaf in sorted(leaves):
            if self.core.is_watched(leaf):
                continue
            when = self._when(leaf)[0]
            reader = parent.get(leaf)
            op = reader[0][1] if reader and reader[0][0] == "lin" else None
            if when == "paused":
                out = self._outside(raw, leaf, "tensor the target is computed from")
                if out is not None and out.cause == STOP_RECORDING:
                    return out
            if when != "recording" or self.info.truncated:
                continue   # (past the lineage limit a leaf may be any op's)
            converted = self._converted(raw, sid, leaf, op, desc)
            if converted is not None:
                return converted
        return Explanation(
            raw, NOT_CONNECTED,
            "the target does not depend on the source through any op the "
            "tape's thread ran while it recorded" +
            (" (the lineage was cut short: too many ops)"
             if self.info.truncated else ""),
            certain=not self.info.truncated)


# The recording layer tells this module about pushes and pops and
# uninstall() (it cannot import diagnostics: imports run downward).
_recording.observe_from_above(tape_observer=note_event, uninstall=take_hooks_out)
# tape.explain names a tf.stop_gradient the trace never holds (TF runs it
# with recording stopped): the recorder notes each one that cuts a tracked
# tensor.
_callback.set_stop_gradient_hook(note_stop_gradient)
