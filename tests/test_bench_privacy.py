"""The bench's DP-SGD runner (fasttape.bench.privacy), against TF."""

import tensorflow as tf

import fasttape
from fasttape.bench import privacy


def test_a_dp_row_times_every_arm_and_checks_the_gradients():
    row = privacy.run_dp_workload(tf, fasttape, privacy.DP_BY_NAME["dp_mlp"],
                                  repeats=2, warmup=1)
    assert row["grads_equal"] is True
    for arm in ("plain", "dp", "vmap fn", "vmap eager"):
        assert row[arm] > 0, arm
    assert "dp_mlp" in privacy.format_dp_table([row])


def test_fasttapes_steps_alternate_apart_from_the_vectorized_map_ones(monkeypatch):
    """Run between fasttape's steps, the traced vectorized_map step slowed
    the step after it: the plain/dp alternation runs first, on its own."""
    calls = []

    def fake_steps(tf_, fasttape_, params, batch, losses):
        def arm(name):
            def step(noise):
                calls.append(name)
                return [tf.constant(1.0)]
            return step
        return {name: arm(name) for name in ("plain", "dp", "vmap fn", "vmap eager")}

    monkeypatch.setattr(privacy, "_steps", fake_steps)
    monkeypatch.setattr(privacy, "EAGER_VMAP_REPEATS", 2)
    privacy.run_dp_workload(tf, fasttape, privacy.DP_BY_NAME["dp_mlp"],
                            repeats=3, warmup=0)
    timed = calls[2:2 + 3 * 2 + 3 + 2]   # after the equality check's two calls
    assert timed == (["plain", "dp"] * 3 + ["vmap fn", "vmap eager"] * 2
                     + ["vmap fn"])
