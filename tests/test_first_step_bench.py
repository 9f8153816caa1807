"""python -m fasttape.bench.first_step: one measurement (run here in this
process, which a real run does in a fresh one) and the printed table."""

import json

from fasttape.bench import first_step


def test_a_measurement_times_both_first_steps_in_the_order_given(capsys):
    first_step._child("embedding", ["ft", "tf"], profile=False)
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(row) == {"import_tf_ms", "import_ft_ms", "ft_first_ms", "tf_second_ms"}
    assert all(v > 0 for v in row.values())


def test_the_table_has_a_row_per_workload_with_the_ratio():
    row = {"tf_first_ms": 60.0, "ft_first_ms": 66.0, "tf_second_ms": 4.0,
           "ft_second_ms": 5.0, "import_ft_ms": 8.0, "ratio": 1.1}
    lines = first_step.format_rows({"mlp_small": row}).splitlines()
    assert lines[0].split()[:4] == ["workload", "tf", "1st", "ft"]
    assert lines[1].split() == ["mlp_small", "60.0", "66.0", "1.10", "4.0", "5.0", "8.0"]
