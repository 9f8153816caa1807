"""DP-SGD for Keras `fit` and the privacy it spends.

``make_private(model, ...)`` makes a Keras 3 model's ``train_step`` compute
its gradient with ``fasttape.GradientTape.dp_gradient``;
``compute_epsilon(...)`` and ``compute_noise_multiplier(...)`` account for
DP-SGD's privacy with Google's dp-accounting package
(``pip install "fasttape[privacy]"``), as TF Privacy's
``compute_dp_sgd_privacy`` does. See docs/privacy.md.
"""

import math
import numbers
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


# -- make_private: DP-SGD under Keras 3's fit ---------------------------------

def make_private(model: Any, *, l2_norm_clip: float, noise_multiplier: float,
                 num_microbatches: int | None = None,
                 seed: int | None = None) -> Any:
    """Makes ``model.fit`` train ``model`` (Keras 3 with the TensorFlow
    backend, or tf_keras) with DP-SGD; returns ``model``.

    Its train step records the forward pass on a ``fasttape.GradientTape``,
    computes the compiled loss per example (each loss with no reduction,
    times its sample weight and loss weight, averaged over the example's
    other axes, summed over the outputs), and applies
    ``tape.dp_gradient(losses, model.trainable_weights, l2_norm_clip,
    noise_multiplier, num_microbatches, seed)`` with the compiled optimizer.
    Metrics and the reported loss are as Keras computes them. The losses of
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
        a ``tf_keras.Model``.
      ValueError: for an ``l2_norm_clip`` that is not positive, a negative
        ``noise_multiplier`` or a ``num_microbatches`` below 1; at the
        first step, for a batch ``num_microbatches`` does not divide, or a
        model compiled without a loss.
    """
    if _tf_keras_model(model):
        losses_of = _tf_keras_per_example_losses
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
        losses_of = _per_example_losses
    l2_norm_clip = _number("l2_norm_clip", l2_norm_clip)
    noise_multiplier = _number("noise_multiplier", noise_multiplier,
                               allow_zero=True)
    if num_microbatches is not None:
        num_microbatches = _number("num_microbatches", num_microbatches,
                                   integer=True)
    if seed is not None:
        seed = _number("seed", seed, integer=True, positive=False)
    dp = (l2_norm_clip, noise_multiplier, num_microbatches, seed)
    model.train_step = lambda data: _dp_train_step(model, data, dp, losses_of)
    model.train_function = None     # (a step compiled before: built again)
    return model


def _per_example_losses(model, y, y_pred, sample_weight):
    """The compiled loss of each example: shape [batch]."""
    import keras  # pylint: disable=import-outside-toplevel
    from keras import ops  # pylint: disable=import-outside-toplevel
    from keras.src.losses.loss import squeeze_or_expand_to_same_rank  # pylint: disable=import-outside-toplevel
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None:
        raise ValueError("make_private: compile the model with a loss "
                         "(model.compile(optimizer, loss=...)) before fit.")
    flat_pred = keras.tree.flatten(y_pred)
    flat_true = keras.tree.flatten(y)
    if len(flat_true) != len(flat_pred):
        raise ValueError(
            f"make_private: y has {len(flat_true)} parts and the model's "
            f"output {len(flat_pred)}: give one target per output, in the "
            "output's structure.")
    if not compiled.built:
        compiled.build(y if len(flat_true) > 1 else flat_true[0],
                       y_pred if len(flat_pred) > 1 else flat_pred[0])
    unreduced = getattr(compiled, "_fasttape_unreduced", None)
    if unreduced is None or unreduced[0] is not compiled._flat_losses:  # pylint: disable=protected-access
        import copy  # pylint: disable=import-outside-toplevel
        losses = []
        for _, fn, weight, _ in compiled._flat_losses:  # pylint: disable=protected-access
            fn = copy.copy(fn)
            fn.reduction = "none"
            losses.append((fn, weight))
        unreduced = compiled._fasttape_unreduced = (compiled._flat_losses, losses)  # pylint: disable=protected-access
    if len(unreduced[1]) != len(flat_pred):
        raise ValueError("make_private: give the model one loss per output.")
    flat_weights = (keras.tree.flatten(sample_weight)
                    if keras.tree.is_nested(sample_weight)
                    else [sample_weight] * len(flat_pred))
    total = None
    for (fn, weight), t, p, w in zip(unreduced[1], flat_true, flat_pred,
                                     flat_weights):
        values = fn(t, p)
        if w is not None:
            # Keras' pairing of the ranks, then a weight per example spread
            # over the example's other axes
            values, w = squeeze_or_expand_to_same_rank(
                values, ops.cast(w, values.dtype))
            if len(w.shape) < len(values.shape):
                w = ops.reshape(w, tuple(w.shape) + (1,) * (
                    len(values.shape) - len(w.shape)))
            values = values * w
        if len(values.shape) > 1:
            values = ops.mean(values, axis=tuple(range(1, len(values.shape))))
        if weight is not None:
            values = values * weight
        total = values if total is None else total + values
    return total


def _tf_keras_model(model):
    import sys  # pylint: disable=import-outside-toplevel
    tf_keras = sys.modules.get("tf_keras")
    return tf_keras is not None and isinstance(model, tf_keras.Model)


def _tf_keras_per_example_losses(model, y, y_pred, sample_weight):
    """_per_example_losses for tf_keras: its LossesContainer's losses
    (compile_utils.LossesContainer.__call__) with no reduction."""
    import copy  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_keras.src.engine import compile_utils  # pylint: disable=import-outside-toplevel
    from tf_keras.src.utils import losses_utils  # pylint: disable=import-outside-toplevel
    compiled = model.compiled_loss
    if compiled is None:
        raise ValueError("make_private: compile the model with a loss "
                         "(model.compile(optimizer, loss=...)) before fit.")
    y = compiled._conform_to_outputs(y_pred, y)  # pylint: disable=protected-access
    sample_weight = compiled._conform_to_outputs(y_pred, sample_weight)  # pylint: disable=protected-access
    if not compiled.built:
        compiled.build(y_pred)
    unreduced = getattr(compiled, "_fasttape_unreduced", None)
    if unreduced is None or unreduced[0] is not compiled._losses:  # pylint: disable=protected-access
        losses = []
        for fn in compiled._losses:  # pylint: disable=protected-access
            if fn is not None:
                fn = copy.copy(fn)
                fn.reduction = losses_utils.ReductionV2.NONE
            losses.append(fn)
        unreduced = compiled._fasttape_unreduced = (compiled._losses, losses)  # pylint: disable=protected-access
    total = None
    for t, p, w, fn, weight in zip(
            tf.nest.flatten(y), tf.nest.flatten(y_pred),
            tf.nest.flatten(sample_weight), unreduced[1],
            compiled._loss_weights):  # pylint: disable=protected-access
        if t is None or fn is None:
            continue
        t, p, w = compile_utils.match_dtype_and_rank(t, p, w)
        w = losses_utils.apply_mask(p, w, losses_utils.get_mask(p))
        values = fn(t, p, sample_weight=w)
        if values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        if weight is not None:
            values = values * weight
        total = values if total is None else total + values
    return total


def _dp_train_step(model, data, dp, losses_of):
    """Keras' train_step (Keras 3: keras/src/backend/tensorflow/trainer.py;
    tf_keras: engine/training.py) with dp_gradient in place of
    tape.gradient."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from fasttape.tape import GradientTape  # pylint: disable=import-outside-toplevel
    l2_norm_clip, noise_multiplier, num_microbatches, seed = dp
    tf_keras = _tf_keras_model(model)
    if tf_keras:
        import tf_keras as keras  # pylint: disable=import-outside-toplevel
        loss_scaled = keras.mixed_precision.LossScaleOptimizer
    else:
        import keras  # pylint: disable=import-outside-toplevel
        loss_scaled = keras.optimizers.LossScaleOptimizer
    if isinstance(model.optimizer, loss_scaled):
        raise NotImplementedError(
            "make_private does not support LossScaleOptimizer (mixed "
            "precision's loss scaling) yet: compile with a float32 policy.")
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    weights = model.trainable_weights
    with GradientTape() as tape:
        if tf_keras or model._call_has_training_arg:  # pylint: disable=protected-access
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        losses = losses_of(model, y, y_pred, sample_weight)
    if seed is not None:
        step = model.optimizer.iterations
        seed = (seed, int(step.numpy()) if tf.executing_eagerly() else step)
    grads = tape.dp_gradient(losses, weights, l2_norm_clip, noise_multiplier,
                             num_microbatches, seed)
    loss = tf.reduce_mean(losses)
    if model.losses:
        # input-independent losses (weight regularizers), not clipped, as
        # TF Privacy: their gradient added to the private one
        with GradientTape() as reg_tape:
            regularization = tf.add_n(model.losses)
        reg_grads = reg_tape.gradient(
            regularization, weights,
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = [g + r if g is not None else r for g, r in zip(grads, reg_grads)]
        loss = loss + tf.cast(regularization, loss.dtype)
    replica = tf.distribute.get_replica_context()
    if replica is not None and replica.num_replicas_in_sync > 1:
        # every replica holds the whole batch's gradient, and Keras'
        # optimizers sum the replicas' gradients
        grads = [None if g is None else g / replica.num_replicas_in_sync
                 for g in grads]
    if tf_keras:
        # the loss metrics, as tf_keras reports them
        model.compiled_loss(y, y_pred, sample_weight,
                            regularization_losses=model.losses)
    else:
        model._loss_tracker.update_state(  # pylint: disable=protected-access
            loss, sample_weight=tf.shape(losses)[0])
    model.optimizer.apply_gradients(zip(grads, weights))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
