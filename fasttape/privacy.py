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
