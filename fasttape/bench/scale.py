"""``python -m fasttape.bench.scale``: recording and backward time of long
chains, fasttape against tf.GradientTape, to show that both grow linearly.

Each length is run ``--rounds`` times, TF's tape and fasttape's alternating
in one process: a chain on a 2x2 tensor (``y = tf.sin(y)``, or with ``--op
mul`` ``y = y * 1.0001``) recorded under the tape (record), then
``tape.gradient`` (backward). Medians are printed, in total and per op,
with fasttape / TF. Not a timed test: a measurement.
"""
import argparse
import gc
import statistics
import time


def _chain_step(tf, tape_class, x, n, op):
    t0 = time.perf_counter()
    with tape_class() as tape:
        tape.watch(x)
        y = x
        if op == "sin":
            for _ in range(n):
                y = tf.sin(y)
        else:
            for _ in range(n):
                y = y * 1.0001
    t1 = time.perf_counter()
    grad = tape.gradient(y, x)
    t2 = time.perf_counter()
    value = float(grad.numpy().sum())
    del tape, y, grad
    return t1 - t0, t2 - t1, value


def measure(tf, fasttape, sizes, rounds, op="sin"):
    """Per size: {"ops", "record_tf_s", "record_ft_s", "backward_tf_s",
    "backward_ft_s"} (medians over ``rounds``), gradients checked equal."""
    x = tf.constant([[0.1, 0.2], [0.3, 0.4]])
    rows = []
    for n in sizes:
        times = {k: [] for k in ("rtf", "rft", "btf", "bft")}
        for _ in range(rounds):
            gc.collect()
            rtf, btf, gtf = _chain_step(tf, tf.GradientTape, x, n, op)
            gc.collect()
            rft, bft, gft = _chain_step(tf, fasttape.GradientTape, x, n, op)
            if abs(gtf - gft) > 1e-4 * abs(gtf):
                raise AssertionError(f"{n} ops: gradients differ ({gtf} vs {gft})")
            for k, v in (("rtf", rtf), ("rft", rft), ("btf", btf), ("bft", bft)):
                times[k].append(v)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"ops": n, "record_tf_s": med["rtf"], "record_ft_s": med["rft"],
                     "backward_tf_s": med["btf"], "backward_ft_s": med["bft"]})
    return rows


def format_rows(rows):
    head = (f"{'ops':>9} {'rec tf s':>9} {'rec ft s':>9} {'ratio':>6} "
            f"{'us/op tf':>8} {'us/op ft':>8}  {'bwd tf s':>9} {'bwd ft s':>9} "
            f"{'ratio':>6} {'us/op tf':>8} {'us/op ft':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        n = r["ops"]
        lines.append(
            f"{n:>9} {r['record_tf_s']:>9.3f} {r['record_ft_s']:>9.3f} "
            f"{r['record_ft_s'] / r['record_tf_s']:>6.2f} "
            f"{r['record_tf_s'] / n * 1e6:>8.2f} {r['record_ft_s'] / n * 1e6:>8.2f}  "
            f"{r['backward_tf_s']:>9.3f} {r['backward_ft_s']:>9.3f} "
            f"{r['backward_ft_s'] / r['backward_tf_s']:>6.2f} "
            f"{r['backward_tf_s'] / n * 1e6:>8.2f} {r['backward_ft_s'] / n * 1e6:>8.2f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m fasttape.bench.scale",
        description="Recording and backward time of long chains, fasttape "
                    "against tf.GradientTape.")
    parser.add_argument("--ops", type=int, nargs="+", default=[10_000, 100_000],
                        help="chain lengths (default 10000 100000; 1000000 "
                             "needs a few GB of memory)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds per length (default 3)")
    parser.add_argument("--op", choices=("sin", "mul"), default="sin",
                        help="the chain: y = tf.sin(y) (default; the fast "
                             "path's recorder) or y = y * 1.0001 (a Python "
                             "number TF converts: the op-callback path)")
    args = parser.parse_args(argv)
    from fasttape.bench import _import_tf
    tf = _import_tf()
    import fasttape
    print(format_rows(measure(tf, fasttape, args.ops, args.rounds, args.op)))
    print("\nseconds, medians of alternating rounds in one process; ratio = "
          "fasttape / tf; a chain of", args.op, "on 2x2.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
