"""fasttape.privacy.compute_epsilon / compute_noise_multiplier against TF
Privacy's published figures. No TensorFlow here (dp-accounting only)."""
import math

import dp_accounting   # the test extra has it (the privacy extra's package)
import pytest

from fasttape import privacy


# TF Privacy's own expectations for compute_dp_sgd_privacy (tensorflow/privacy,
# tensorflow_privacy/privacy/analysis/compute_dp_sgd_privacy_test.py,
# test_compute_dp_sgd_privacy: n, batch_size, noise_multiplier, epochs, delta,
# expected_eps), which that library gets from dp-accounting's RDP accountant
# with the orders of privacy.RDP_ORDERS.
TF_PRIVACY_RDP = [
    (60000, 150, 1.3, 15, 1e-5, 0.7242234026109595),
    (100000, 100, 1.0, 30, 1e-7, 1.4154988495444842),
    (100000000, 1024, 0.1, 10, 1e-7, 5907982.3113984),
]


@pytest.mark.parametrize("n, batch, noise, epochs, delta, expected", TF_PRIVACY_RDP)
def test_rdp_gives_tf_privacy_figures(n, batch, noise, epochs, delta, expected):
    eps = privacy.compute_epsilon(noise_multiplier=noise, batch_size=batch,
                                  num_examples=n, epochs=epochs, delta=delta)
    assert eps == pytest.approx(expected, rel=1e-9)


def test_mnist_tutorial():
    """TF Privacy's tutorials/README.md: the MNIST tutorial's defaults
    (noise 1.1, batch 256, 60000 examples, 60 epochs, delta 1e-5) and
    `compute_dp_sgd_privacy.py --N=60000 --batch_size=256
    --noise_multiplier=1.1 --epochs=60 --delta=1e-5` state eps = 3.01 (and
    1.03, 1.11 after 1 and 2 epochs). Those figures are the classic
    RDP-to-(eps, delta) conversion, min over orders of
    rdp - log(delta) / (order - 1), with the tutorial's orders
    (1 + x/10 for x in 1..99, then 12..63); dp-accounting (and so TF
    Privacy's library today) converts with a tighter bound, which gives 2.60.
    Both from the same accountant state: the published figures check the
    RDP curve, the library's figure the conversion."""
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    q = 256 / 60000
    for epochs, published in ((1, 1.03), (2, 1.11), (60, 3.01)):
        accountant = dp_accounting.rdp.RdpAccountant(orders)
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(1.1)),
            math.ceil(epochs * 60000 / 256)))
        classic = min(r - math.log(1e-5) / (o - 1)
                      for r, o in zip(accountant.rdp, orders))
        assert round(classic, 2) == published
    eps = privacy.compute_epsilon(noise_multiplier=1.1, batch_size=256,
                                  num_examples=60000, epochs=60, delta=1e-5)
    assert eps == pytest.approx(2.5970795196566616, rel=1e-9)
    pld = privacy.compute_epsilon(noise_multiplier=1.1, batch_size=256,
                                  num_examples=60000, epochs=60, delta=1e-5,
                                  accountant="pld")
    # PLD is tighter than RDP, by a few tenths here
    assert 2.2 < pld < eps


def test_steps_round_up_and_zero_noise():
    """ceil(epochs * n / batch) steps, as TF Privacy: 1.05 epochs of 1000
    examples in batches of 100 is 11 steps, not 10."""
    kwargs = dict(noise_multiplier=1.0, batch_size=100, num_examples=1000,
                  delta=1e-5)
    eps = []
    for steps in (10, 11):
        accountant = dp_accounting.rdp.RdpAccountant(privacy.RDP_ORDERS)
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                0.1, dp_accounting.GaussianDpEvent(1.0)), steps))
        eps.append(accountant.get_epsilon(1e-5))
    assert privacy.compute_epsilon(epochs=1.05, **kwargs) == pytest.approx(
        eps[1], rel=1e-12)
    assert eps[0] < eps[1]
    kwargs["noise_multiplier"] = 0
    assert privacy.compute_epsilon(epochs=1, **kwargs) == math.inf


# (PLD: a small case; each PLD costs up to a second)
@pytest.mark.parametrize("accountant, n, batch, epsilon", [
    ("rdp", 60000, 256, 3.0), ("pld", 1000, 500, 1.0)])
def test_noise_multiplier_inverts_epsilon(accountant, n, batch, epsilon):
    kwargs = dict(batch_size=batch, num_examples=n, epochs=1, delta=1e-5,
                  accountant=accountant)
    sigma = privacy.compute_noise_multiplier(epsilon=epsilon, **kwargs)
    assert privacy.compute_epsilon(noise_multiplier=sigma, **kwargs) == \
        pytest.approx(epsilon, rel=1e-3)
    assert privacy.compute_epsilon(noise_multiplier=sigma * 0.99,
                                   **kwargs) > epsilon


GOOD = dict(noise_multiplier=1.1, batch_size=256, num_examples=60000,
            epochs=1, delta=1e-5)


@pytest.mark.parametrize("name, value", [
    ("noise_multiplier", -1.0), ("noise_multiplier", "1.1"),
    ("noise_multiplier", math.nan),
    ("batch_size", 0), ("batch_size", 2.5), ("batch_size", True),
    ("batch_size", 60001),
    ("num_examples", -5), ("num_examples", None),
    ("epochs", -1), ("epochs", 0), ("epochs", math.inf),
    ("delta", 0), ("delta", 1.0), ("delta", -1e-5),
    ("accountant", "RDP"), ("accountant", "moments"),
])
def test_bad_argument_is_named(name, value):
    with pytest.raises(ValueError, match=name):
        privacy.compute_epsilon(**dict(GOOD, **{name: value}))


def test_bad_epsilon_is_named():
    kwargs = {k: v for k, v in GOOD.items() if k != "noise_multiplier"}
    with pytest.raises(ValueError, match="epsilon"):
        privacy.compute_noise_multiplier(epsilon=0, **kwargs)
    with pytest.raises(TypeError):
        privacy.compute_epsilon(1.1, 256, 60000, 1, 1e-5)   # keywords only
