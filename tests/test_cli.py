"""python -m fasttape run / bench, end to end in subprocesses."""

import json
import os
import subprocess
import sys
import textwrap

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


def _run(args, cwd):
    return subprocess.run([sys.executable, "-m", "fasttape", *args], cwd=cwd,
                          env=ENV, capture_output=True, text=True, timeout=300)


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


def test_bench_prints_its_table_and_writes_json(tmp_path):
    result = tmp_path / "bench.json"
    out = _run(["bench", "--workloads", "chain", "jvp", "--repeats", "2",
                "--warmup", "0", "--json", str(result)], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "ratio" in out.stdout and "chain" in out.stdout
    rows = json.loads(result.read_text())
    assert [r["workload"] for r in rows] == ["chain", "jvp"]
    assert all(r["grads_equal"] for r in rows)
    assert all(r["fasttape_ms"] > 0 and r["tf_ms"] > 0 for r in rows)
