"""First steps in a fresh process: TF's against fasttape's.

``python -m fasttape.bench.first_step [--workloads ...] [--processes N]``

Each measurement is one new Python process that imports TensorFlow and
fasttape (``fasttape.GradientTape`` resolved, as a user's import does),
builds the workload and times the first gradient step of each tape. The one
that runs first in a process also pays TF's one-time costs (the forward ops'
kernels, TF's own lazy imports), so half the processes run TF first and half
fasttape first, and each tape's first step is the median over the processes
where it ran first. (The second step of the other tape is printed too: what a
step costs once the forward kernels exist.) Modules are imported from
compiled bytecode, as from an installed package: one uncounted process per
workload fills the cache first.

``--profile`` runs one more process, fasttape first, under cProfile, and
prints its costliest functions.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

DEFAULT_WORKLOADS = ("mlp_small", "mlp_large", "cnn", "rnn",
                     "varlen_attention", "embedding")


def _child(name, order, profile, warm_forward=False):
    """One measurement, in this (fresh) process: prints a JSON line."""
    import time
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t0 = time.perf_counter()
    from fasttape.bench import _import_tf
    tf = _import_tf()
    t1 = time.perf_counter()
    import fasttape
    impls = {"ft": fasttape, "tf": tf}
    fasttape.GradientTape   # noqa: B018  (resolved, as `from fasttape import GradientTape`)
    fasttape.ForwardAccumulator   # noqa: B018
    t2 = time.perf_counter()
    from fasttape.bench.workloads import BY_NAME
    from fasttape.bench.timing import _Impl

    forward, record = BY_NAME[name].make(tf)
    if warm_forward:
        forward()
    result = {"import_tf_ms": (t1 - t0) * 1e3, "import_ft_ms": (t2 - t1) * 1e3}
    profiler = None
    for i, key in enumerate(order):
        impl = impls[key]
        impl = _Impl(impl.GradientTape, getattr(impl, "ForwardAccumulator", None)
                     or tf.autodiff.ForwardAccumulator)
        if profile and key == "ft":
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        start = time.perf_counter()
        record(impl)()
        seconds = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        result[f"{key}_{'first' if i == 0 else 'second'}_ms"] = seconds * 1e3
    print(json.dumps(result), flush=True)
    if profiler is not None:
        import pstats
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(25)


# Children compile their modules once into this cache, as an installed
# package's .pyc files (PYTHONDONTWRITEBYTECODE would have every child
# compile fasttape's and TF's lazily imported modules inside its first step).
PYCACHE = os.path.join(tempfile.gettempdir(), "fasttape-first-step-pycache")


def _run_child(name, order, profile=False, warm_forward=False):
    cmd = [sys.executable, "-X", f"pycache_prefix={PYCACHE}",
           "-m", "fasttape.bench.first_step", "--child", name,
           "--order", ",".join(order)] + (["--profile"] if profile else []) + (
               ["--warm-forward"] if warm_forward else [])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode:
        raise RuntimeError(f"{name}: child failed:\n{out.stderr[-3000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    return json.loads(line), out.stderr


def measure(names=DEFAULT_WORKLOADS, processes=6, warm_forward=False):
    """{workload: {"tf_first_ms": median, "ft_first_ms": median, ...}}:
    ``processes`` fresh processes per workload, orders alternated."""
    rows = {}
    for name in names:
        _run_child(name, ("tf", "ft"))   # not counted: fills PYCACHE
        runs = [_run_child(name, ("tf", "ft") if i % 2 == 0 else ("ft", "tf"),
                           warm_forward=warm_forward)[0]
                for i in range(processes)]
        row = {}
        for key in ("tf_first_ms", "ft_first_ms", "tf_second_ms", "ft_second_ms",
                    "import_ft_ms"):
            values = [r[key] for r in runs if key in r]
            row[key] = statistics.median(values)
        row["ratio"] = row["ft_first_ms"] / row["tf_first_ms"]
        rows[name] = row
    return rows


def format_rows(rows):
    lines = [f"{'workload':18} {'tf 1st':>8} {'ft 1st':>8} {'ratio':>6}   "
             f"{'tf 2nd':>8} {'ft 2nd':>8}   {'import ft':>9}  (ms, medians)"]
    for name, r in rows.items():
        lines.append(f"{name:18} {r['tf_first_ms']:8.1f} {r['ft_first_ms']:8.1f} "
                     f"{r['ratio']:6.2f}   {r['tf_second_ms']:8.1f} "
                     f"{r['ft_second_ms']:8.1f}   {r['import_ft_ms']:9.1f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fasttape.bench.first_step")
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS))
    parser.add_argument("--processes", type=int, default=6,
                        help="fresh processes per workload (half TF first)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile fasttape's first step (one process each)")
    parser.add_argument("--profile-order", default="tf,ft",
                        help="which tape steps first in the profiled process "
                        "(tf,ft: fasttape's own one-time costs show alone)")
    parser.add_argument("--warm-forward", action="store_true",
                        help="run the forward pass once with no tape first: "
                        "the first steps then create only the backward's kernels")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--order", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.order.split(","), args.profile, args.warm_forward)
        return
    if args.profile:
        for name in args.workloads:
            result, err = _run_child(name, args.profile_order.split(","),
                                     profile=True, warm_forward=args.warm_forward)
            print(f"== {name}: {result}\n{err}")
        return
    rows = measure(args.workloads, args.processes, args.warm_forward)
    print(json.dumps(rows, indent=1) if args.json else format_rows(rows))


if __name__ == "__main__":
    main()
