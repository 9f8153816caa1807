"""One backward pass over a recorded tape, and the argument checks that
GradientTape.gradient and the Jacobians share (fasttape.tape, _jacobians).
"""

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.eager import backprop
from tensorflow.python.ops import default_gradient
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.platform import tf_logging as logging

from fasttape.gradients import _compiled
from fasttape.recording import _budget
from fasttape.recording import _recording
from fasttape.recording._callback import output_meta


handle_or_self = backprop._handle_or_self  # pylint: disable=protected-access

# TF's text, then what to do about it.
USE_PERSISTENT = (". To compute more than one, create the tape with "
                  "GradientTape(persistent=True) (and `del` it when done, "
                  "to free what it holds)")
CONSUMED = ("A non-persistent GradientTape can only be used to compute one "
            "set of gradients (or jacobians)" + USE_PERSISTENT)


def unconnected(value):
    if type(value) is UnconnectedGradients:
        return value
    try:
        return UnconnectedGradients(value)
    except ValueError:
        raise ValueError(
            "Unknown value for unconnected_gradients: %r" % value) from None


def compute(tape_state, flat_targets, flat_sources, output_gradients,
            flat_sources_raw, unconnected_gradients, retain=False,
            all_watched=False):
    """Run the core's backward pass for flat lists of tensors.

    all_watched: run the backward function of every op between the targets
    and any watched tensor, as TF's tape does, not only of those that lead
    to a source. Given for output_gradients from the user: TF's gradient
    functions then check them (a seed of the wrong dtype or shape fails
    there even when no source is connected)."""
    unconnected_gradients = unconnected(unconnected_gradients)
    target_ids = [t._id for t in flat_targets]  # pylint: disable=protected-access
    source_ids = [t._id for t in flat_sources]  # pylint: disable=protected-access
    targets_set = set(target_ids)
    sources_that_are_targets = {
        t._id: output_meta(t)  # pylint: disable=protected-access
        for t in flat_sources if t._id in targets_set}  # pylint: disable=protected-access
    core, vspace = tape_state.core, _recording.VSPACE
    target_meta = [output_meta(t) for t in flat_targets]

    pass_vspace = vspace
    recompute = None
    if tape_state.budget is not None:
        pass_vspace = _budget.backward_vspace(tape_state, vspace)
        # A compiled pass re-makes the dropped tensors inside its function.
        recompute = _budget.GraphRecompute(tape_state.budget)

    def eager_pass():
        return core.compute_gradient(
            pass_vspace, target_ids, source_ids, sources_that_are_targets,
            output_gradients, True, retain, target_meta, all_watched)

    # (Anomaly mode and the profiler are properties of the vspace, for
    # which the compiled cache runs eager_pass.)
    grads = _compiled.gradient(core, vspace, target_ids, source_ids,
                               sources_that_are_targets, output_gradients,
                               retain, target_meta, eager_pass, all_watched,
                               recompute=recompute)
    if unconnected_gradients == UnconnectedGradients.ZERO:
        grads = [default_gradient.zeros_like(flat_sources_raw[i])
                 if g is None else g for i, g in enumerate(grads)]
    return grads


def vlog_untrainable(what, t):
    logging.vlog(
        1, f"The dtype of the {what} tensor must be "
        "floating (e.g. tf.float32) when calling GradientTape.gradient, "
        "got %r", t.dtype)


def check_tensors(flat, what):
    """TF fails on a non-tensor target or source with Python's
    AttributeError (reading its dtype or _id); fasttape adds what to do."""
    for t in flat:
        for attr in ("dtype", "_id"):
            try:
                getattr(t, attr)
            except AttributeError as exc:
                hint = (". Sources must be tensors or Variables: convert a "
                        "NumPy array or Python number with x = tf.constant(a) "
                        "and call tape.watch(x) before computing the target "
                        "from x" if what == "sources" else
                        ". Targets must be tensors (or Variables) computed "
                        "while the tape recorded")
                raise AttributeError(str(exc) + hint) from None
