"""python -m fasttape run / bench, end to end in subprocesses."""

import io
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from fasttape import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The checkout's fasttape, whatever else is installed (the subprocesses run
# in a temporary directory).
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
           PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
# The bench as a user starts it: no TF_CPP_MIN_LOG_LEVEL of their own.
BENCH_ENV = {k: v for k, v in ENV.items() if k != "TF_CPP_MIN_LOG_LEVEL"}


def _run(args, cwd, env=ENV):
    return subprocess.run([sys.executable, "-m", "fasttape", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_run_swaps_tfs_classes_into_an_unmodified_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        import tensorflow as tf
        x = tf.constant(3.0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x * x
        print("tape", type(tape).__module__)
        print("grad", float(tape.gradient(y, x)))
        print("argv", sys.argv[1:])
        print("name", __name__)
    """))
    out = _run(["run", str(script), "--lr", "0.1"], tmp_path)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("tape", "grad", "argv", "name"))
    assert lines["tape"] == "fasttape.tape"
    assert lines["grad"] == "6.0"
    assert lines["argv"] == "['--lr', '0.1']"
    assert lines["name"] == "__main__"


def test_run_without_a_script_is_a_usage_error(tmp_path):
    out = _run(["run"], tmp_path)
    assert out.returncode == 2
    assert "usage" in out.stderr


# absl's format (TF >= 2.16: "I0000 00:00:1796372741.896627   13300 port.cc:153] ...")
# and TF's older one ("2024-01-01 12:00:00.000000: I tensorflow/...").
CPP_LOG_LINE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ |"
                          r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] )", re.M)


def test_bench_prints_its_table_writes_json_and_plot_and_no_tf_noise(tmp_path):
    # jacobian: TF's pfor jacobian retraces a new tf.function per call; its
    # fifth call is where TF warns about it (2 checks + 4 timed steps here).
    result, png = tmp_path / "bench.json", tmp_path / "bench.png"
    out = _run(["bench", "--workloads", "chain", "jvp", "jacobian", "--repeats", "4",
                "--warmup", "0", "--json", str(result), "--plot", str(png)],
               tmp_path, env=BENCH_ENV)
    assert out.returncode == 0, out.stderr
    assert "ratio" in out.stdout and "chain" in out.stdout
    # Up front: roughly how long the run takes.
    assert re.fullmatch(r"3 workload\(s\), 4 timed steps each: about \d+ (s|min) "
                        r"\(a rough estimate\)", out.stdout.splitlines()[0])
    rows = json.loads(result.read_text())
    assert [r["workload"] for r in rows] == ["chain", "jvp", "jacobian"]
    # TF's step traced by tf.function, beside the eager tapes.
    head = next(line for line in out.stdout.splitlines()
                if line.startswith("workload ") and "ratio" in line)
    assert head.split()[1:8] == ["floor", "tf", "tf.fn", "xla", "fasttape",
                                 "ratio", "ft/fn"], head
    chain = rows[0]
    assert chain["tf_function_ms"] > 0
    # Its later timed steps replay a compiled pass, whose calls are timed.
    assert 0 < chain["compiled_pass_ms"] < chain["fasttape_ms"]
    assert chain["ratio_to_tf_function"] == pytest.approx(
        chain["fasttape_ms"] / chain["tf_function_ms"])
    assert all("xla_ms" in r for r in rows)
    assert all(r["grads_equal"] for r in rows)
    assert all(r["fasttape_ms"] > 0 and r["tf_ms"] > 0 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Not a terminal: one line per workload instead of the bar.
    assert out.stderr.splitlines() == ["  chain: done", "  jvp: done",
                                       "  jacobian: done"], out.stderr
    both = out.stdout + out.stderr
    assert not CPP_LOG_LINE.search(both)
    assert "absl::InitializeLog" not in both and "retracing" not in both


def test_bench_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import fails
    with pytest.raises(SystemExit) as exc:
        bench.main(["--plot", str(tmp_path / "x.png")])
    assert "fasttape[plot]" in str(exc.value)
    assert not (tmp_path / "x.png").exists()


def _row(name, floor, tf, ft, rec_tf, rec_ft):
    return {"workload": name, "floor_ms": floor, "tf_ms": tf, "fasttape_ms": ft,
            "ratio": ft / tf, "record_overhead_tf_ms": rec_tf,
            "record_overhead_fasttape_ms": rec_ft}


def test_plot_splits_each_step_into_floor_recording_backward(tmp_path):
    row = _row("a", 2.0, 10.0, 5.0, 1.0, -0.25)
    parts = bench.step_parts(row)
    assert parts["tf"] == {"floor": 2.0, "recording": 1.0, "backward": 7.0, "total": 10.0}
    assert parts["fasttape"] == {"floor": 2.0, "recording": -0.25, "backward": 3.25,
                                 "total": 5.0}
    # A negative split (noise between medians) is drawn as 0; panels for
    # any number of workloads.
    rows = [row] + [_row(f"w{i}", 1.0, 3.0 + i, 2.0, 0.5, 0.5) for i in range(6)]
    bench.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_the_floor_plus_the_compiled_pass_bounds_the_ratio():
    """The line that says how far fasttape's own work could take a ratio:
    the forward floor plus the compiled pass's calls, over TF's step; none
    for a workload whose timed steps did not all replay compiled passes."""
    rows = [dict(_row("mlp", 2.0, 10.0, 5.0, 1.0, 0.5), compiled_pass_ms=1.5,
                 backward="compiled"),
            dict(_row("eager", 2.0, 10.0, 5.0, 1.0, 0.5), compiled_pass_ms=None,
                 backward="eager"),
            dict(_row("varlen", 2.0, 10.0, 5.0, 1.0, 0.5), compiled_pass_ms=1.0,
                 backward="mixed")]
    assert bench.format_pass_bound(rows) == (
        "mlp: fasttape / tf 0.50; forward floor + compiled pass 0.35 "
        "(the pass: 1.500 ms)")


def test_progress_bar_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    progress = bench._Progress(total=3)
    progress.start("chain")
    for _ in range(3):
        progress.tick()
    progress.done("chain")
    progress.close()
    assert "chain" in err.getvalue() and "/3" in err.getvalue()
    assert "done" not in err.getvalue()


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_bench_bad_repeats_is_one_argparse_error_line(value, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--workloads", "chain", "--repeats", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m fasttape bench: error: argument --repeats: ")
    assert not [line for line in err if "Traceback" in line or "KeyError" in line]


def test_every_printed_median_shows_its_spread():
    row = dict(_row("a", 2.0, 10.0, 5.0, 1.0, 0.5), held_bytes_tf=0,
               held_bytes_fasttape=0, backward="eager", grads_equal=True,
               spread_ms={"floor": (1.9, 2.1), "tf": (9.0, 11.0), "ft": (4.5, 5.5),
                          "ratio": (0.4, 0.6), "rec_tf": (2.5, 3.5),
                          "rec_ft": (2.0, 3.0)})
    table = bench.format_table([row])
    line = table.splitlines()[2]
    for cell in ("2.00 ±0.10", "10.00 ±1.00", "5.00 ±0.50", "0.50 ±0.10",
                 "1.00 ±0.50", "0.50 ±0.50"):
        assert cell in line, (cell, line)
    assert bench.iqr_ms([0.001, 0.002, 0.003, 0.004, 0.005]) == (2.0, 4.0)
    assert bench.iqr_ms([0.003]) == (3.0, 3.0)


def test_a_column_that_does_not_apply_reads_n_a():
    row = dict(_row("varlen", 2.0, 10.0, 5.0, 1.0, 0.5), held_bytes_tf=0,
               held_bytes_fasttape=0, backward="eager", grads_equal=True,
               tf_function_ms=None, xla_ms=None, ratio_to_tf_function=None)
    line = bench.format_table([row]).splitlines()[2]
    assert line.split()[3:5] == ["n/a", "n/a"] and line.split()[7] == "n/a", line


def test_recording_dying_drops_its_tape_with_no_gradient():
    """The recording arm of recording_dying frees the tape and all it
    recorded: nothing is left for a backward pass."""
    import weakref

    import tensorflow as tf

    import fasttape
    workload = bench.BY_NAME["recording_dying"]
    assert workload.ops_per_step == bench.RECORDING_OPS
    _, record = workload.make(tf)
    made = []

    class Tape(fasttape.GradientTape):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    impl = bench.timing._Impl(Tape, fasttape.ForwardAccumulator)
    finish = record(impl)
    assert len(made) == 1 and made[0]() is None
    assert finish() is None


def test_a_workload_says_what_it_measures():
    """The per-op recording line comes from ops_per_step, whatever the
    workload's name (no special case of "recording")."""
    assert bench.BY_NAME["recording"].ops_per_step == bench.RECORDING_OPS
    assert bench.BY_NAME["chain"].ops_per_step is None
    rows = [dict(_row("sin_chain", 1.0, 3.0, 2.0, 0.5, 0.25), ops_per_step=250,
                 spread_ms={}),
            dict(_row("recording", 1.0, 3.0, 2.0, 0.5, 0.25), ops_per_step=None)]
    text = bench.format_per_op(rows)
    assert text.splitlines() == [
        "sin_chain: recording overhead per op above the floor: tf 2.00 us, "
        "fasttape 1.00 us (0.50x TF's); the forward pass under the tape, per "
        "op: 0.83x TF's"]


def test_per_op_workloads_take_enough_steps():
    """The per-op recording workloads run PER_OP_STEPS timed steps at
    least, whatever --repeats asks; more when it asks more; the others as
    asked (those whose shapes change: VARIABLE_STEPS at least)."""
    counts = bench.timing._counts
    for name in ("recording", "recording_dying"):
        workload = bench.BY_NAME[name]
        assert counts(workload, 30, 3) == (bench.timing.PER_OP_STEPS, 3)
        assert counts(workload, 500, 0) == (500, 0)
    assert bench.timing.PER_OP_STEPS > 30
    assert counts(bench.BY_NAME["mlp_small"], 30, 3) == (30, 3)
    assert counts(bench.BY_NAME["varlen_rnn"], 30, 3) == (bench.VARIABLE_STEPS, 0)


def test_the_graph_split_adds_up_to_the_ratio():
    rows = [dict(_row("mlp", 2.0, 10.0, 5.0, 1.0, 0.5), tf_function_ms=2.5),
            dict(_row("varlen", 2.0, 10.0, 5.0, 1.0, 0.5), tf_function_ms=None)]
    assert bench.format_graph_split(rows).splitlines() == [
        "mlp: fasttape / tf.function 2.00 = forward floor 0.80 + recording 0.20"
        " + backward 1.00"]


def test_the_cache_tables_means_show_their_spread():
    row = {"workload": "varlen", "tf_first_ms": 10.0, "fasttape_first_ms": 12.0,
           "fasttape_build_step_ms": None, "builds": 0, "build_seconds": 0.0,
           "cache": {}, "hit_rate": None, "tf_mean_ms": 5.0,
           "fasttape_mean_ms": 3.0, "fasttape_off_mean_ms": 4.0,
           "mean_ratio": 0.6, "mean_ratio_to_off": 0.75,
           "spread_ms": {"tf": (4.0, 6.0), "ft": (2.5, 3.5), "off": (3.0, 5.0),
                         "ratio": (0.5, 0.7), "ratio_to_off": (0.7, 0.8)}}
    line = bench.format_cache_table([row]).splitlines()[2]
    for cell in ("5.00 ±1.00", "3.00 ±0.50", "4.00 ±1.00", "0.60 ±0.10", "0.75 ±0.05"):
        assert cell in line, (cell, line)
