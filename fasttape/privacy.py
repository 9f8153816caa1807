"""DP-SGD for Keras `fit` and the privacy it spends.

``make_private(model, ...)`` makes a Keras 3 model's ``train_step`` compute
its gradient with ``fasttape.GradientTape.dp_gradient``;
``compute_epsilon(...)`` and ``compute_noise_multiplier(...)`` account for
DP-SGD's privacy with Google's dp-accounting package
(``pip install "fasttape[privacy]"``), as TF Privacy's
``compute_dp_sgd_privacy`` does. See docs/privacy.md.
"""

import inspect
import math
import numbers
import sys
import threading
from typing import Any

# TF Privacy's RDP orders (compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy
# and compute_noise_from_budget_lib): the same orders give its figures.
RDP_ORDERS = ([1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5]
              + list(range(5, 64)) + [128, 256, 512])

_ACCOUNTANTS = ("rdp", "pld")


def _dp_accounting():
    try:
        import dp_accounting  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError(
            "fasttape.privacy's accounting needs the dp-accounting package: "
            'pip install "fasttape[privacy]" (or pip install dp-accounting)'
        ) from e
    return dp_accounting


def _number(name, value, *, integer=False, positive=True, allow_zero=False):
    """``value`` as a float (or int), or a ValueError naming the argument."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, "
                         f"got {value!r}")
    value = int(value) if integer else float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and not (value > 0 or allow_zero and value == 0):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else 'positive'}, "
                         f"got {value!r}")
    return value


def _sampling(batch_size, num_examples, epochs, delta, accountant):
    """Checks the arguments shared by the two accounting functions; returns
    (sampling probability, steps)."""
    batch_size = _number("batch_size", batch_size, integer=True)
    num_examples = _number("num_examples", num_examples, integer=True)
    epochs = _number("epochs", epochs)
    delta = _number("delta", delta)
    if batch_size > num_examples:
        raise ValueError(f"batch_size ({batch_size}) must be at most "
                         f"num_examples ({num_examples})")
    if not delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if accountant not in _ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {_ACCOUNTANTS}, "
                         f"got {accountant!r}")
    return batch_size / num_examples, math.ceil(epochs * num_examples / batch_size)


def _accountant(dp_accounting, accountant):
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant(RDP_ORDERS)
    return dp_accounting.pld.PLDAccountant()


def _event(dp_accounting, q, steps, noise_multiplier):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(noise_multiplier)), steps)


def compute_epsilon(*, noise_multiplier: float, batch_size: int,
                    num_examples: int, epochs: float, delta: float,
                    accountant: str = "rdp") -> float:
    """The epsilon DP-SGD spends, for the given delta.

    Each step is a Gaussian mechanism of standard deviation
    ``noise_multiplier`` (over the clipping norm) on a Poisson sample of
    the data with probability ``batch_size / num_examples``, repeated
    ``ceil(epochs * num_examples / batch_size)`` times: TF Privacy's
    ``compute_dp_sgd_privacy``, whose figures the ``"rdp"`` accountant gives
    (with TF Privacy's orders, ``RDP_ORDERS``). ``"pld"``: dp-accounting's
    privacy loss distribution accountant (tighter).

    Returns:
      A float (``inf`` when ``noise_multiplier`` is 0 and a step is taken).

    Raises:
      ValueError: naming the argument that is out of range, or
        ``accountant`` other than ``"rdp"`` or ``"pld"``.
      ImportError: without the dp-accounting package.
    """
    noise_multiplier = _number("noise_multiplier", noise_multiplier,
                               allow_zero=True)
    q, steps = _sampling(batch_size, num_examples, epochs, delta, accountant)
    dp_accounting = _dp_accounting()
    acc = _accountant(dp_accounting, accountant)
    acc.compose(_event(dp_accounting, q, steps, noise_multiplier))
    return float(acc.get_epsilon(float(delta)))


def compute_noise_multiplier(*, epsilon: float, batch_size: int,
                             num_examples: int, epochs: float, delta: float,
                             accountant: str = "rdp") -> float:
    """The smallest noise multiplier whose compute_epsilon() for these
    arguments is at most ``epsilon`` (dp-accounting's calibration, as TF
    Privacy's ``compute_noise_from_budget``; ``"pld"`` to a relative
    tolerance of 1e-4, and slower: seconds).

    Raises:
      ValueError: as compute_epsilon(), or for an ``epsilon`` that is not
        positive.
    """
    epsilon = _number("epsilon", epsilon)
    q, steps = _sampling(batch_size, num_examples, epochs, delta, accountant)
    dp_accounting = _dp_accounting()

    def calibrate(kind, bracket, tol=None):
        return float(dp_accounting.calibrate_dp_mechanism(
            lambda: _accountant(dp_accounting, kind),
            lambda sigma: _event(dp_accounting, q, steps, sigma),
            epsilon, float(delta), bracket, tol=tol))

    sigma = calibrate("rdp", dp_accounting.LowerEndpointAndGuess(1e-3, 1.0))
    if accountant == "pld":
        # PLD's bound is the tighter: its noise is below RDP's, and a bracket
        # from near 0 would build a PLD of billions of points. Each PLD costs
        # up to a second: a tolerance of 1e-4 relative.
        sigma = calibrate("pld", dp_accounting.ExplicitBracketInterval(
            sigma / 2, sigma), tol=sigma * 1e-4)
    return sigma


# -- make_private: DP-SGD under Keras' fit -------------------------------------
#
# The step runs Keras' own model.compute_loss on a fasttape tape. Each loss in
# the container Keras built from compile's `loss` is wrapped by
# _PerExampleLoss, which returns what the loss returns (Keras' reduction over
# the batch) and, while a DP step runs, also hands the step each example's
# loss: the same loss on a batch of that example alone, as TF Privacy's DP
# models compute it (the compiled loss on each microbatch of one example).
# So Keras itself matches losses to outputs and targets (lists, dicts,
# outputs with no loss), weighs them by `loss_weights`, and reports the loss
# and the metrics as in a plain step.

# Methods whose override make_private's step would bypass: the step replaces
# train_step, and computes the compiled loss per example.
_BYPASSED = ("train_step", "compute_loss", "make_train_function")

_collecting = threading.local()     # .sink: the list a DP step collects into


def _frameworks(keras3):
    """(the keras or tf_keras module, its name and version, as messages say)."""
    if keras3:
        import keras  # pylint: disable=import-outside-toplevel
        return keras, f"Keras {keras.__version__}"
    import tf_keras  # pylint: disable=import-outside-toplevel
    return tf_keras, f"tf_keras {tf_keras.__version__}"


def _unsupported_keras(problem, keras3):
    return RuntimeError(
        f"make_private: {problem} in {_frameworks(keras3)[1]} (fasttape.privacy "
        "follows Keras 3.15 and tf_keras 2.21): write the training step "
        "with fasttape.GradientTape.dp_gradient (docs/privacy.md).")


def _private(obj, name, keras3):
    """obj.name, a private Keras attribute; RuntimeError naming the Keras
    version where it is missing."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _unsupported_keras(
            f"Keras' {type(obj).__name__}.{name} is missing", keras3) from None


def _internals(keras3):
    """Keras' private loss helpers the per-example losses mirror."""
    try:
        if keras3:
            from keras.src.backend import get_keras_mask  # pylint: disable=import-outside-toplevel
            from keras.src.losses import loss  # pylint: disable=import-outside-toplevel
            return (get_keras_mask, loss.reduce_weighted_values,
                    loss.squeeze_or_expand_to_same_rank)
        from tf_keras.src.utils import losses_utils  # pylint: disable=import-outside-toplevel
        return losses_utils
    except (ImportError, AttributeError) as e:
        raise _unsupported_keras(f"Keras' loss helpers are missing ({e})",
                                 keras3) from None


def _bypassed_override(model, keras3):
    """'Class.method' for a method of _BYPASSED that the model overrides
    (its class, or the instance), else None."""
    package = "keras." if keras3 else "tf_keras."
    for name in _BYPASSED:
        own = vars(model).get(name)
        if own is not None and not getattr(own, "_fasttape_dp_step", False):
            return f"the model's own {name} attribute"
        for cls in type(model).__mro__:
            if name in vars(cls):
                if not cls.__module__.startswith(package):
                    return f"{cls.__qualname__}.{name}"
                break
    return None


def make_private(model: Any, *, l2_norm_clip: float, noise_multiplier: float,
                 num_microbatches: int | None = None,
                 seed: int | None = None) -> Any:
    """Makes ``model.fit`` train ``model`` (Keras 3 with the TensorFlow
    backend, or tf_keras) with DP-SGD; returns ``model``.

    Its train step is Keras' own with ``tape.dp_gradient(losses,
    model.trainable_weights, l2_norm_clip, noise_multiplier,
    num_microbatches, seed)`` in place of ``tape.gradient``: ``losses[i]``
    is example i's compiled loss, the loss Keras computes on a batch of that
    example alone (its outputs' losses, each with its sample weight and
    mask, times its ``loss_weights``, summed; a masked loss averaged over
    the example's own valid entries). Keras matches losses to outputs and
    reports the loss and the metrics as in a plain step. The losses of
    ``model.losses`` (weight regularizers) are added after clipping and
    noise, as TF Privacy's DP models do: they must not depend on the data
    (a loss added with ``add_loss`` in ``call`` is reported, but takes no
    part in the gradient). With ``seed``, step k draws its noise from
    ``(seed, k)``, k the optimizer's iteration count.

    Works with ``model.compile(...)`` called before or after. Under a
    tf.distribute strategy each replica clips its own examples and the
    noise is added once (see ``GradientTape.dp_gradient``).

    Raises:
      TypeError: for a model that is neither a Keras 3 ``keras.Model`` nor
        a ``tf_keras.Model``, or one that overrides ``train_step``,
        ``compute_loss`` or ``make_train_function`` (the DP step would not
        run them); at the first step, for a ``Loss`` subclass that
        overrides ``__call__``.
      ValueError: for an ``l2_norm_clip`` that is not positive, a negative
        ``noise_multiplier`` or a ``num_microbatches`` below 1; at the
        first step, for a model compiled without a loss, a loss with no value per example,
        ``"mean_with_sample_weight"`` with sample weights, several
        losses on one output, or a trainable ``BatchNormalization`` layer
        (its batch statistics mix the examples).
      tf.errors.InvalidArgumentError: at the step of a batch
        ``num_microbatches`` does not divide (the last one of a dataset,
        often: batch it with ``drop_remainder=True``), compiled or eagerly.
      NotImplementedError: at the first step, with a
        ``LossScaleOptimizer`` (mixed_float16's loss scaling).
      RuntimeError: at the first step, where the Keras installed lacks or
        changed the private parts make_private reads (naming them and the
        version).
    """
    if _tf_keras_model(model):
        keras3 = False
    else:
        import keras  # pylint: disable=import-outside-toplevel
        if not isinstance(model, keras.Model):
            raise TypeError(
                "make_private takes a Keras 3 keras.Model (TensorFlow "
                f"backend) or a tf_keras one, got {type(model).__name__}; for "
                "another model, call fasttape.GradientTape.dp_gradient in its "
                "training step.")
        if keras.backend.backend() != "tensorflow":
            raise TypeError("make_private needs Keras' TensorFlow backend, got "
                            f"{keras.backend.backend()!r}")
        keras3 = True
    overridden = _bypassed_override(model, keras3)
    if overridden is not None:
        raise TypeError(
            f"make_private: {overridden} overrides Keras' own, which the DP "
            "training step would not run (it computes the compiled loss per "
            "example and clips each example's gradient): train on a loss "
            "given to model.compile(loss=...) (a keras.losses.Loss whose "
            "call() returns a value per example), or write the training "
            "step with fasttape.GradientTape.dp_gradient (docs/privacy.md).")
    l2_norm_clip = _number("l2_norm_clip", l2_norm_clip)
    noise_multiplier = _number("noise_multiplier", noise_multiplier,
                               allow_zero=True)
    if num_microbatches is not None:
        num_microbatches = _number("num_microbatches", num_microbatches,
                                   integer=True)
    if seed is not None:
        seed = _number("seed", seed, integer=True, positive=False)
    dp = (l2_norm_clip, noise_multiplier, num_microbatches, seed)

    def train_step(data):
        return _dp_train_step(model, data, dp, keras3)

    train_step._fasttape_dp_step = True  # pylint: disable=protected-access
    model.train_step = train_step
    model.train_function = None     # (a step compiled before: built again)
    return model


def _tf_keras_model(model):
    tf_keras = sys.modules.get("tf_keras")
    return tf_keras is not None and isinstance(model, tf_keras.Model)


class _PerExampleLoss:
    """One compiled loss, called by Keras' loss container as the loss was:
    returns what the loss returns; inside a DP step, also appends each
    example's loss, times ``weight`` (the loss's ``loss_weights``), to the
    step's sink."""

    def __init__(self, loss, weight, keras3):
        self.loss, self.weight, self.keras3 = loss, weight, keras3

    def __getattr__(self, name):    # (tf_keras' container reads .reduction)
        if name in ("loss", "weight", "keras3"):
            raise AttributeError(name)
        return getattr(self.loss, name)

    def __call__(self, y_true, y_pred, sample_weight=None):
        sink = getattr(_collecting, "sink", None)
        if sink is None:
            return self.loss(y_true, y_pred, sample_weight)
        losses_of = _keras3_losses if self.keras3 else _tf_keras_losses
        per_example, reduced = losses_of(self.loss, y_true, y_pred,
                                         sample_weight)
        if self.weight is not None:
            per_example = per_example * self.weight
        sink.append(per_example)
        return reduced


def _check_per_example(values, loss):
    if values.shape.rank == 0:
        raise ValueError(
            f"make_private: the loss {getattr(loss, 'name', type(loss).__name__)} "
            "returns one value for the whole batch; DP-SGD needs a value per "
            "example: its call() must return shape [batch, ...].")


def _keras3_losses(loss, y_true, y_pred, sample_weight):
    """Keras 3's Loss.__call__ (keras/src/losses/loss.py), which returns
    reduce_weighted_values(...) over the batch: returns (each example's
    loss, that reduction)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel
    from keras import ops, tree  # pylint: disable=import-outside-toplevel
    get_keras_mask, reduce_weighted_values, same_rank = _internals(True)
    in_mask = get_keras_mask(y_pred)
    with keras.name_scope(loss.name):
        y_pred = tree.map_structure(
            lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_pred)
        y_true = tree.map_structure(
            lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_true)
        values = loss.call(y_true, y_pred)
        out_mask = get_keras_mask(values)
        mask = (in_mask & out_mask if in_mask is not None and out_mask is not None
                else out_mask if in_mask is None else in_mask)
        reduced = reduce_weighted_values(
            values, sample_weight=sample_weight, mask=mask,
            reduction=loss.reduction, dtype=loss.dtype)

        # reduce_weighted_values for each example alone
        reduction = loss.reduction
        values = ops.convert_to_tensor(values, dtype=loss.dtype)
        _check_per_example(values, loss)
        if reduction == "mean_with_sample_weight" and sample_weight is not None:
            raise ValueError(
                "make_private: the reduction 'mean_with_sample_weight' divides "
                "by the sum of the batch's sample weights, which ties each "
                "example's loss to the others' (and on one example cancels its "
                "weight): use 'sum_over_batch_size' with sample weights.")
        if sample_weight is not None:
            sample_weight = ops.convert_to_tensor(sample_weight, dtype=loss.dtype)
        if mask is not None:
            mask = ops.convert_to_tensor(mask, dtype=loss.dtype)
            if reduction in ("mean", "sum_over_batch_size"):
                # Keras weighs a valid entry total / valid, over the batch
                # (the batch's mean over its valid entries): here over the
                # example's own entries
                total = tf.cast(tf.reduce_prod(tf.shape(mask)[1:]), mask.dtype)
                valid = tf.reduce_sum(mask, axis=list(range(1, mask.shape.rank)),
                                      keepdims=True)
                mask = tf.where(tf.cast(mask, tf.bool),
                                tf.math.divide_no_nan(total, valid),
                                tf.zeros_like(mask))
            if sample_weight is not None:
                mask, sample_weight = same_rank(mask, sample_weight)
                sample_weight = sample_weight * mask
            else:
                sample_weight = mask
        if sample_weight is not None:
            values, sample_weight = same_rank(
                values, tf.cast(sample_weight, values.dtype))
            values = values * sample_weight
        per_example = _sum_per_example(values)
        if reduction in ("sum_over_batch_size", "mean", "mean_with_sample_weight"):
            if reduction == "mean_with_sample_weight" and sample_weight is not None:
                divisor = _sum_per_example(sample_weight)   # (the mask)
            else:
                divisor = tf.cast(tf.reduce_prod(tf.shape(values)[1:]),
                                  values.dtype)
            per_example = tf.math.divide_no_nan(per_example, divisor)
        # "sum", and no reduction (whose gradient is the sum's): the sum
    return per_example, reduced


def _sum_per_example(values):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if values.shape.rank == 1:
        return values
    return tf.reduce_sum(values, axis=list(range(1, values.shape.rank)))


def _tf_keras_losses(loss, y_true, y_pred, sample_weight):
    """tf_keras' Loss.__call__ (tf_keras/src/losses.py), which returns
    compute_weighted_loss(...) over the batch: returns (each example's loss,
    that reduction)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    losses_utils = _internals(False)
    reduction = _private(loss, "_get_reduction", False)()
    with tf.name_scope(_private(loss, "_name_scope", False)):
        if tf.executing_eagerly():
            call = loss.call
        else:
            call = tf.__internal__.autograph.tf_convert(
                loss.call, tf.__internal__.autograph.control_status_ctx())
        values = call(y_true, y_pred)
        in_mask = losses_utils.get_mask(y_pred)
        out_mask = losses_utils.get_mask(values)
        mask = (in_mask & out_mask if in_mask is not None and out_mask is not None
                else out_mask if in_mask is None else in_mask)
        reduced = losses_utils.compute_weighted_loss(
            values, losses_utils.apply_valid_mask(values, sample_weight, mask,
                                                  reduction),
            reduction=reduction)

        # compute_weighted_loss(apply_valid_mask(...)) for each example alone
        values = tf.convert_to_tensor(values)
        _check_per_example(values, loss)
        if not values.dtype.is_floating:
            values = tf.cast(values, tf.float32)
        over_size = reduction in (losses_utils.ReductionV2.AUTO,
                                  losses_utils.ReductionV2.SUM_OVER_BATCH_SIZE)
        if mask is not None:
            mask = tf.cast(mask, values.dtype)
            if over_size:   # (as in _keras3_losses)
                total = tf.cast(tf.reduce_prod(tf.shape(mask)[1:]), mask.dtype)
                valid = tf.reduce_sum(mask, axis=list(range(1, mask.shape.rank)),
                                      keepdims=True)
                mask = mask * tf.math.divide_no_nan(total, valid)
            sample_weight = losses_utils.apply_mask(values, sample_weight, mask)
        if sample_weight is not None:
            values, _, sample_weight = losses_utils.squeeze_or_expand_dimensions(
                values, None, tf.cast(sample_weight, values.dtype))
            values = values * sample_weight
        per_example = _sum_per_example(values)
        if over_size:
            per_example = tf.math.divide_no_nan(per_example, tf.cast(
                tf.reduce_prod(tf.shape(values)[1:]), values.dtype))
    return per_example, reduced


def _loss_container(model, keras3):
    """The container Keras built from compile's loss, whose losses are (or,
    when it builds, will be) _PerExampleLoss."""
    if keras3:
        container = _private(model, "_compile_loss", True)
    else:
        container = getattr(model, "compiled_loss", None)
    if container is None:
        raise ValueError("make_private: compile the model with a loss "
                         "(model.compile(optimizer, loss=...)) before fit.")
    if not getattr(container, "_fasttape_wrapped", False):
        if _private(container, "built", keras3):
            _wrap_losses(container, keras3)
        else:
            build = _private(container, "build", keras3)

            def build_and_wrap(*args, **kwargs):
                build(*args, **kwargs)
                _wrap_losses(container, keras3)

            container.build = build_and_wrap
        container._fasttape_wrapped = True  # pylint: disable=protected-access
    return container


def _wrap_losses(container, keras3):
    keras, _ = _frameworks(keras3)
    base = keras.losses.Loss

    def wrapped(loss, weight):
        if loss is None or isinstance(loss, _PerExampleLoss):
            return loss
        if not isinstance(loss, base) or type(loss).__call__ is not base.__call__:
            raise TypeError(
                f"make_private: the loss {type(loss).__name__} is not a "
                f"{base.__module__}.Loss that leaves its __call__ to Keras, so "
                "its value per example is unknown: override call() (a value "
                "per example, or per example and position) and leave the "
                "reduction to Keras.")
        return _PerExampleLoss(loss, weight, keras3)

    if keras3:
        entries = _private(container, "_flat_losses", True)
        if not all(hasattr(e, "_replace") and hasattr(e, "loss")
                   and hasattr(e, "loss_weights") for e in entries):
            raise _unsupported_keras("Keras' CompileLoss._flat_losses entries "
                                     "are not (path, loss, loss_weights, name)",
                                     True)
        container._flat_losses = [  # pylint: disable=protected-access
            e._replace(loss=wrapped(e.loss, e.loss_weights)) for e in entries]
    else:
        losses = _private(container, "_losses", False)
        weights = _private(container, "_loss_weights", False)
        container._losses = [  # pylint: disable=protected-access
            wrapped(loss, weight) for loss, weight in zip(losses, weights,
                                                          strict=True)]


def _refuse_batch_statistics(model, keras):
    """ValueError for a BatchNormalization layer that trains on its batch's
    statistics (a trainable one: Keras 3's and tf_keras' normalize a frozen
    one by its moving statistics). dp_gradient refuses the op that mixes
    examples where it lies on a weight's path, but statistics of the input
    itself, taken before any weight, are ops the tape never records."""
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise ValueError(
                f"make_private: layer {layer.name!r} (BatchNormalization) "
                "normalizes each batch by the batch's own statistics in "
                "training, so each example's gradient depends on the other "
                "examples and clipping it does not bound one example's share "
                "(DP-SGD's guarantee). Use LayerNormalization or "
                "GroupNormalization, or freeze the layer "
                "(layer.trainable = False: Keras then normalizes by its "
                "moving statistics).")


def _dp_train_step(model, data, dp, keras3):
    """Keras' train_step (Keras 3: keras/src/backend/tensorflow/trainer.py;
    tf_keras: engine/training.py) with dp_gradient of the per-example
    losses in place of tape.gradient of their reduction."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from fasttape.tape import GradientTape  # pylint: disable=import-outside-toplevel
    l2_norm_clip, noise_multiplier, num_microbatches, seed = dp
    keras, _ = _frameworks(keras3)
    loss_scaled = (keras.optimizers.LossScaleOptimizer if keras3
                   else keras.mixed_precision.LossScaleOptimizer)
    if isinstance(model.optimizer, loss_scaled):
        raise NotImplementedError(
            "make_private does not support LossScaleOptimizer (mixed_float16's "
            "loss scaling): its dynamic scale would have to enter the clipping "
            "norm, and its choice to skip a step when a gradient overflows "
            "depends on single examples' gradients, which DP-SGD's noise does "
            "not cover. Train with the 'mixed_bfloat16' or 'float32' policy, "
            "which scale no loss.")
    _refuse_batch_statistics(model, keras)
    container = _loss_container(model, keras3)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    weights = model.trainable_weights
    sink, outer = [], getattr(_collecting, "sink", None)
    with GradientTape() as tape:
        if not keras3 or "training" in inspect.signature(model.call).parameters:
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        _collecting.sink = sink
        try:    # Keras' own: its loss and metrics reported as in a plain step
            if keras3:
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred,
                                          sample_weight=sample_weight,
                                          training=True)
            else:
                loss = model.compute_loss(x, y, y_pred, sample_weight)
        finally:
            _collecting.sink = outer
        if not sink:
            raise ValueError("make_private: compile the model with a loss "
                             "(model.compile(optimizer, loss=...)) before fit.")
        # each compiled loss once (Keras 3 computes them all; tf_keras skips
        # an output with no target): else Keras computes its loss otherwise
        # than the per-example losses would sum
        wrapped = sum(isinstance(e, _PerExampleLoss) for e in (
            [e.loss for e in container._flat_losses] if keras3  # pylint: disable=protected-access
            else container._losses))  # pylint: disable=protected-access
        if keras3 and wrapped > 1 and not keras.tree.is_nested(y_pred):
            raise ValueError(
                f"make_private: {wrapped} losses for the model's one output, "
                "of which Keras trains on the first alone: give one loss.")
        if len(sink) > wrapped or keras3 and len(sink) != wrapped:
            raise _unsupported_keras(
                f"Keras' compiled loss computed {len(sink)} losses for "
                f"{wrapped} compiled ones", keras3)
        losses = tf.add_n([tf.cast(v, loss.dtype) for v in sink])
    if seed is not None:
        step = model.optimizer.iterations
        seed = (seed, int(step.numpy()) if tf.executing_eagerly() else step)
    grads = tape.dp_gradient(losses, weights, l2_norm_clip, noise_multiplier,
                             num_microbatches, seed)
    if model.losses:
        # input-independent losses (weight regularizers), not clipped, as
        # TF Privacy: their gradient added to the private one
        with GradientTape() as reg_tape:
            regularization = tf.add_n(model.losses)
        reg_grads = reg_tape.gradient(
            regularization, weights,
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = [g + r if g is not None else r for g, r in zip(grads, reg_grads)]
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1:
        # every replica holds the whole batch's gradient, and Keras'
        # optimizers sum the replicas' gradients
        grads = [None if g is None else g / replicas for g in grads]
    if keras3:
        # Keras 3's train_step reports the loss so (tf_keras' compute_loss
        # did); Keras divided it by the replicas
        _private(model, "_loss_tracker", True).update_state(
            loss * replicas,
            sample_weight=tf.shape(next(i for i in keras.tree.flatten(x)
                                        if i is not None))[0])
    model.optimizer.apply_gradients(zip(grads, weights))
    return model.compute_metrics(x, y, y_pred, sample_weight)
