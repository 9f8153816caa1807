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


def test_the_compared_steps_alternate_in_rotated_order(monkeypatch):
    """plain, dp and vmap fn alternate, each round in a rotated order (each
    follows each other as often; the machine's drift falls on all three);
    the eager vectorized_map step, which traces per call, runs after them."""
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
                            repeats=4, warmup=0)
    timed = calls[2:2 + 4 * 3 + 2]   # after the equality check's two calls
    assert timed == (["plain", "dp", "vmap fn"] + ["dp", "vmap fn", "plain"]
                     + ["vmap fn", "plain", "dp"] + ["plain", "dp", "vmap fn"]
                     + ["vmap eager"] * 2)


def test_the_table_gives_ratios_of_medians_and_of_means(monkeypatch):
    """A dp step that pays for its next steps' noise on one step in four:
    the table prints the ratio of medians and the ratio of means, which
    counts that step."""
    clock = [0.0]
    cost = {"plain": [1.0], "dp": [0.8, 0.8, 0.8, 2.0], "vmap fn": [1.0],
            "vmap eager": [50.0]}
    count = {}

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock[0]

    def fake_steps(tf_, fasttape_, params, batch, losses):
        def arm(name):
            def step(noise):
                i = count[name] = count.get(name, -1) + 1
                clock[0] += cost[name][i % len(cost[name])] / 1e3
                return [tf.constant(1.0)]
            return step
        return {name: arm(name) for name in cost}

    monkeypatch.setattr(privacy, "_steps", fake_steps)
    monkeypatch.setattr(privacy, "peak_mb", lambda tf_, step: None)
    monkeypatch.setattr(privacy, "time", FakeTime)
    row = privacy.run_dp_workload(tf, fasttape, privacy.DP_BY_NAME["dp_mlp"],
                                  repeats=8, warmup=0)
    assert abs(row["dp"] - 0.8) < 1e-9 and abs(row["dp mean"] - 1.1) < 1e-9
    last = privacy.format_dp_table([row]).splitlines()[1].split()
    assert last[-2:] == ["1.10", "1.10"]          # means: dp/plain, dp/vmap fn
    assert "0.80" in last                          # medians: dp/plain, dp/vmap fn


def test_a_compiled_dp_row_times_every_arm_and_checks_the_gradients():
    """dpc_*: TF's plain and noised steps, fasttape's dp_gradient and the
    traced vectorized_map, each in tf.function; the DP step checked equal
    to vectorized_map's without noise; extra peak memory per arm."""
    row = privacy.run_dp_compiled_workload(
        tf, fasttape, privacy.DP_COMPILED_BY_NAME["dpc_mlp"], repeats=2, warmup=0)
    assert row["grads_equal"] is True
    for arm in ("plain fn", "+noise fn", "dp fn", "vmap fn"):
        assert row[arm] > 0, arm
    lines = privacy.format_dp_compiled_table([row, dict(row, workload="dpc_gen9")])
    assert "dpc_mlp" in lines and "generated models, dp fn / plain fn: median" in lines
    # the noise's own cost beside the DP step's: TF's noised step over its plain one
    cells = lines.splitlines()[1].split()
    assert cells[1 + 2 * 4:][:3] == [f"{row['dp fn'] / row['plain fn']:.2f}",
                                     f"{row['dp fn'] / row['+noise fn']:.2f}",
                                     f"{row['+noise fn'] / row['plain fn']:.2f}"]
    assert "generated models, +noise fn / plain fn: median" in lines
