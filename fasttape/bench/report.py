"""The bench's printed tables: medians with their spread, the per-op
recording cost of workloads that measure it, the compiled-pass cache."""


def with_spread(value, spread, digits=2):
    """``value ±h``: h is half the interquartile range ``spread`` (q1, q3)."""
    if spread is None:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} ±{(spread[1] - spread[0]) / 2:.{digits}f}"


def format_table(rows):
    """Medians, each with ± half its interquartile range (the timed steps)."""
    cols = (("floor", "floor_ms", "floor"), ("tf", "tf_ms", "tf"),
            ("tf.fn", "tf_function_ms", "fn"), ("xla", "xla_ms", "xla"),
            ("fasttape", "fasttape_ms", "ft"), ("ratio", "ratio", "ratio"),
            ("ft/fn", "ratio_to_tf_function", "ratio_to_fn"),
            ("rec tf", "record_overhead_tf_ms", "rec_tf"),
            ("rec ft", "record_overhead_fasttape_ms", "rec_ft"))
    cells = [[_cell(r, key, arm) for _, key, arm in cols] for r in rows]
    widths = [max([len(title)] + [len(c[i]) for c in cells])
              for i, (title, _, _) in enumerate(cols)]
    head = (f"{'workload':<16} "
            + " ".join(f"{title:>{w}}" for (title, _, _), w in zip(cols, widths))
            + f" {'held tf':>8} {'held ft':>8}  {'ft backward':<11}  grads")
    lines = [head, "-" * len(head)]
    for r, c in zip(rows, cells):
        lines.append(
            f"{r['workload']:<16} " + " ".join(f"{v:>{w}}" for v, w in zip(c, widths))
            + f" {_kib(r['held_bytes_tf']):>8} {_kib(r['held_bytes_fasttape']):>8}  "
            f"{r['backward']:<11}  {'equal' if r['grads_equal'] else 'DIFFER'}")
    return "\n".join(lines)


def _cell(row, key, arm):
    """A median with its spread; n/a for a column that does not apply
    (the traced steps of a workload that has none)."""
    if row.get(key) is None:
        return "n/a"
    return with_spread(row[key], row.get("spread_ms", {}).get(arm))


def format_per_op(rows):
    """For each workload that measures recording per op (ops_per_step): each
    tape's recording overhead per op, with its spread."""
    lines = []
    for r in rows:
        n = r.get("ops_per_step")
        if not n:
            continue
        spread = r.get("spread_ms", {})
        per_op = []
        for impl, key, arm in (("tf", "record_overhead_tf_ms", "rec_tf"),
                               ("fasttape", "record_overhead_fasttape_ms", "rec_ft")):
            s = spread.get(arm)
            per_op.append(f"{impl} " + with_spread(
                r[key] / n * 1e3, s and (s[0] / n * 1e3, s[1] / n * 1e3)) + " us")
        whole = ((r["floor_ms"] + r["record_overhead_fasttape_ms"])
                 / (r["floor_ms"] + r["record_overhead_tf_ms"]))
        lines.append(f"{r['workload']}: recording overhead per op above the floor: "
                     f"{per_op[0]}, {per_op[1]} "
                     f"({r['record_overhead_fasttape_ms'] / r['record_overhead_tf_ms']:.2f}x TF's); "
                     f"the forward pass under the tape, per op: {whole:.2f}x TF's")
    return "\n".join(lines)


def format_graph_split(rows):
    """For each workload with a tf.function step: fasttape's eager step
    over it, split into the forward floor (the eager forward without a
    tape), recording and backward, each over the tf.function step: where
    the floor alone is above a target, no tape can meet it."""
    lines = []
    for r in rows:
        fn = r.get("tf_function_ms")
        if not fn:
            continue
        rec = r["record_overhead_fasttape_ms"]
        backward = r["fasttape_ms"] - r["floor_ms"] - rec
        lines.append(f"{r['workload']}: fasttape / tf.function {r['fasttape_ms'] / fn:.2f}"
                     f" = forward floor {r['floor_ms'] / fn:.2f} + recording "
                     f"{rec / fn:.2f} + backward {backward / fn:.2f}")
    return "\n".join(lines)


def format_pass_bound(rows):
    """For each workload whose timed steps all replayed compiled passes:
    fasttape's step over TF's, and what the forward floor plus the
    compiled passes' calls alone (TF's executor running their kernels) come
    to over TF's step: no work of fasttape's own could take its ratio below
    that."""
    lines = []
    for r in rows:
        call = r.get("compiled_pass_ms")
        if call is None or r["backward"] != "compiled":
            continue
        lines.append(f"{r['workload']}: fasttape / tf {r['ratio']:.2f}; forward "
                     f"floor + compiled pass {(r['floor_ms'] + call) / r['tf_ms']:.2f}"
                     f" (the pass: {call:.3f} ms)")
    return "\n".join(lines)


def format_cache_table(rows):
    """First steps (one each), builds of compiled passes and the cache's
    churn (counts); for variable-shape workloads, mean step times against
    TF's and against fasttape with the compiled backward off, each with ±
    half the interquartile range of its steps (of the per-step ratios)."""
    def opt(value, fmt):
        return "-" if value is None else format(value, fmt)

    def spread(r, value, arm):
        if value is None:
            return "-"
        return with_spread(value, r.get("spread_ms", {}).get(arm))

    cols = (("tf mean", "tf_mean_ms", "tf"), ("ft mean", "fasttape_mean_ms", "ft"),
            ("off mean", "fasttape_off_mean_ms", "off"),
            ("m ratio", "mean_ratio", "ratio"),
            ("ft/off", "mean_ratio_to_off", "ratio_to_off"))
    cells = [[spread(r, r[key], arm) for _, key, arm in cols] for r in rows]
    widths = [max([len(title)] + [len(c[i]) for c in cells])
              for i, (title, _, _) in enumerate(cols)]
    head = (f"{'workload':<16} {'tf 1st':>7} {'ft 1st':>7} {'ft build':>8}"
            f" {'builds':>6} {'build s':>7} {'keys':>5} {'hits':>5} "
            + " ".join(f"{title:>{w}}" for (title, _, _), w in zip(cols, widths)))
    lines = [head, "-" * len(head)]
    for r, c in zip(rows, cells):
        cache = r["cache"]
        lines.append(
            f"{r['workload']:<16} {r['tf_first_ms']:>7.1f} "
            f"{r['fasttape_first_ms']:>7.1f} "
            f"{opt(r['fasttape_build_step_ms'], '>8.1f')} {r['builds']:>6} "
            f"{r['build_seconds']:>7.2f} {cache.get('new_keys', 0):>5} "
            f"{opt(r['hit_rate'] and 100 * r['hit_rate'], '>4.0f')}% "
            + " ".join(f"{v:>{w}}" for v, w in zip(c, widths)))
    return "\n".join(lines)


def _kib(n):
    return f"{n / 1024:.0f}K"
