"""``python -m fasttape bench``: fasttape against tf.GradientTape, side by side.

Each workload is run in one process, in alternation (each round in a shuffled
order): the forward pass with no tape (the floor), tf.GradientTape,
fasttape.GradientTape. Gradients of the
two tapes are checked equal before anything is timed. Medians are printed, each
with its spread (± half the interquartile range), and the ratio fasttape/tf (below 1 means fasttape is faster).

TensorFlow is imported quietly (see ``_import_tf``) and TF's own warning that
its pfor jacobian retraces is filtered: both are noise about TF, not about the
measurement. A progress bar goes to stderr (tqdm, on a terminal).

The package: ``workloads`` (what is run, and what each workload measures),
``timing`` (how it is run and measured), ``report`` (the printed tables),
``plot`` (the picture); this module is the command line.
"""
import argparse
import cProfile
import json
import logging
import os
import sys

from fasttape.bench.plot import PLOT_PARTS, _check_plotting, plot, step_parts  # noqa: F401
from fasttape.bench.report import (  # noqa: F401
    format_cache_table, format_graph_split, format_pass_bound, format_per_op,
    format_table)
from fasttape.bench.timing import (  # noqa: F401
    _counts, _native_stderr_to_file, check_equal, estimate_seconds, held_bytes,
    iqr_ms, run_workload)
from fasttape.bench.workloads import (  # noqa: F401
    BY_NAME, RECORDING_OPS, VARIABLE_STEPS, WORKLOADS, Workload)
from fasttape.bench.privacy import DP_BY_NAME, format_dp_table, run_dp_workload
from fasttape.bench.privacy import (DP_COMPILED_BY_NAME, format_dp_compiled_table,
                                    run_dp_compiled_workload)
from fasttape.bench.memory import (MEM_BY_NAME, MEM_FAMILY, format_family_table, format_mem_table,
                                   run_mem_family, run_mem_workload)


def _startup_output_hidden():
    """Whether TF's start-up output is hidden: unless the user chose a
    ``TF_CPP_MIN_LOG_LEVEL`` (``0`` shows everything)."""
    return "TF_CPP_MIN_LOG_LEVEL" not in os.environ


def _import_tf():
    """``import tensorflow``, quietly.

    TF's C++ start-up lines (oneDNN, CUDA probing, CPU features) are written
    through absl before TF applies ``TF_CPP_MIN_LOG_LEVEL`` (TF 2.21 writes
    them even at level 3), so setting the variable is not enough: the import
    and the runtime's start (where the device probing logs) run with file
    descriptor 2 sent to a temporary file, shown only if they fail, and the
    level is set to 2 (errors only) for the rest of the run. A user who sets
    ``TF_CPP_MIN_LOG_LEVEL`` gets TF's output as they asked for it."""
    if "tensorflow" in sys.modules or not _startup_output_hidden():
        import tensorflow as tf
        return tf
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    with _native_stderr_to_file():
        import tensorflow as tf
        tf.config.list_logical_devices("CPU")
    return tf


class _DropRetracingWarnings(logging.Filter):
    """TF warns when its pfor jacobian (a new tf.function per call) retraces:
    that is the cost being measured, not news."""

    def filter(self, record):
        return "triggered tf.function retracing" not in record.getMessage()


class _Progress:
    """A tqdm bar on stderr when stderr is a terminal; otherwise one line per
    finished workload."""

    def __init__(self, total):
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=sys.stderr, unit="step",
                            dynamic_ncols=True, leave=False)

    def start(self, name):
        if self.bar is not None:
            self.bar.set_description(name)

    def tick(self):
        if self.bar is not None:
            self.bar.update(1)

    def done(self, name):
        if self.bar is None:
            print(f"  {name}: done", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _at_least(low):
    """An argparse type: an integer of at least ``low`` (one clear error line
    for 0 or -1 repeats, instead of a failure deep in the run)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value
    parse.__name__ = "integer"
    return parse


def _duration(seconds):
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    return f"{seconds / 60:.0f} min"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m fasttape bench",
        description="fasttape.GradientTape against tf.GradientTape, side by side.")
    parser.add_argument("--workloads", nargs="+",
                        choices=(sorted(BY_NAME) + sorted(DP_BY_NAME)
                                 + sorted(DP_COMPILED_BY_NAME) + sorted(MEM_BY_NAME)
                                 + [MEM_FAMILY]),
                        default=[w.name for w in WORKLOADS],
                        help="default: all but the DP-SGD ones (dp_*), which "
                             "compare fasttape's dp_gradient with vectorized_map, "
                             "the compiled DP-SGD ones (dpc_*: tf.function steps "
                             "of Keras models, fasttape's dp_gradient against "
                             "TF's plain step and vectorized_map), "
                             "and the memory-budget ones (mem_*), which compare "
                             "budgets of 50%% and 25%% with none (mem_family: "
                             "generated models)")
    parser.add_argument("--repeats", type=_at_least(1), default=30,
                        help="timed steps per workload and tape (default 30; the "
                             "per-op recording workloads take 101 at least, "
                             "those whose shapes change 200)")
    parser.add_argument("--warmup", type=_at_least(0), default=3,
                        help="untimed steps before them (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write results as JSON")
    parser.add_argument("--profile", metavar="FILE",
                        help="write cProfile stats of the fasttape steps (pstats/snakeviz)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw each workload's step time split into floor / "
                             "recording / backward, TF and fasttape side by side "
                             "(needs matplotlib: pip install 'fasttape[plot]')")
    args = parser.parse_args(argv)
    if args.plot:
        _check_plotting()

    tf = _import_tf()
    import fasttape

    retracing = _DropRetracingWarnings()
    tf_logger = logging.getLogger("tensorflow")
    tf_logger.addFilter(retracing)
    profiler = cProfile.Profile() if args.profile else None
    dp_workloads = [DP_BY_NAME[name] for name in args.workloads
                    if name in DP_BY_NAME]
    dpc_workloads = [DP_COMPILED_BY_NAME[name] for name in args.workloads
                     if name in DP_COMPILED_BY_NAME]
    workloads = [BY_NAME[name] for name in args.workloads if name in BY_NAME]
    mem_workloads = [MEM_BY_NAME[name] for name in args.workloads
                     if name in MEM_BY_NAME]
    if MEM_FAMILY in args.workloads:
        family_rows = run_mem_family(tf, fasttape, args.repeats, args.warmup)
        print(format_family_table(family_rows))
        print("\nmem_family: generated models (fasttape/bench/family.py, fixed "
              "seed); held/budget = the most bytes only the tape holds at any "
              "step over the budget;\nbound = held within the budget plus the "
              "largest saved tensor (warned: it is not, and the tape gave a "
              "MemoryBudgetWarning naming why); ratio = median of per-step ratios to the "
              "unbudgeted step;\npeak = TF's CPU allocator's peak over two "
              "steps after the timed ones, fall = its drop from the unbudgeted "
              "step's.\n")
        if not all(r["grads_equal"] and (r["bound"] or r["warned"])
                   for r in family_rows):
            print("ERROR: budgeted gradients differ or the bound breaks on: " + ", ".join(
                sorted({r["workload"] for r in family_rows
                        if not (r["grads_equal"] and (r["bound"] or r["warned"]))})),
                  file=sys.stderr)
            return 1
        if not mem_workloads and not workloads and not dp_workloads \
                and not dpc_workloads:
            return 0
    if mem_workloads:
        mem_rows = [row for w in mem_workloads
                    for row in run_mem_workload(tf, fasttape, w, args.repeats, args.warmup)]
        print(format_mem_table(mem_rows))
        print("\nheld = the most bytes only the tape holds at any step; ms per step "
              "median ± half the IQR; ratio = median of per-step ratios to the "
              "unbudgeted step;\npeak RSS = the process's peak resident memory "
              "over two steps above its resident memory before them, each in a "
              "fresh process;\nsteady = the same after eight steps (compiled "
              "passes in use), TF's pooled blocks counted by TF's statistics "
              "(see fasttape/bench/memory.py);\ndropped / re-run = tensors dropped and ops re-run "
              "in one step.\n")
        if not all(r["grads_equal"] for r in mem_rows):
            print("ERROR: budgeted gradients differ from unbudgeted ones on: "
                  + ", ".join(sorted({r["workload"] for r in mem_rows
                                      if not r["grads_equal"]})), file=sys.stderr)
            return 1
        if not workloads and not dp_workloads and not dpc_workloads:
            return 0
    if dpc_workloads:
        dpc_rows = []
        for w in dpc_workloads:
            dpc_rows.append(run_dp_compiled_workload(tf, fasttape, w, args.repeats,
                                                     args.warmup))
            print(format_dp_compiled_table(dpc_rows[-1:]).splitlines()[1], flush=True)
        print()
        print(format_dp_compiled_table(dpc_rows))
        print("\nms per step of a Keras model in tf.function (gradients, no optimizer), "
              "medians of alternating runs,\n± half the interquartile range. plain fn "
              "= tf.GradientTape, the mean loss; +noise fn = the same plus\nTF's normal "
              "noise on every gradient (the floor of any DP step); dp fn = fasttape's "
              "dp_gradient\n(clip, sum, noise); vmap fn = vectorized_map over "
              "single-example tf.GradientTape's. MB = extra peak\nmemory of one step "
              "(TF's CPU allocator).\n")
        if not all(r["grads_equal"] for r in dpc_rows):
            print("ERROR: the compiled dp_gradient differs from vectorized_map on: "
                  + ", ".join(r["workload"] for r in dpc_rows if not r["grads_equal"]),
                  file=sys.stderr)
            return 1
        if not workloads and not dp_workloads:
            return 0
    if dp_workloads:
        dp_rows = [run_dp_workload(tf, fasttape, w, args.repeats, args.warmup)
                   for w in dp_workloads]
        print(format_dp_table(dp_rows))
        print("\nms per DP-SGD step (clip and noise), medians of alternating "
              "runs, ± half the interquartile range;\nmeans: the ratios of mean "
              "step times (dp draws its noise a few steps ahead: some steps pay "
              "for the next ones').\nplain = fasttape's "
              "non-private step; dp = tape.dp_gradient; vmap fn / vmap eager = "
              "vectorized_map over\nsingle-example tf.GradientTape's, in and "
              "out of tf.function.\n")
        if not all(r["grads_equal"] for r in dp_rows):
            print("ERROR: dp_gradient differs from vectorized_map on: " + ", ".join(
                r["workload"] for r in dp_rows if not r["grads_equal"]),
                file=sys.stderr)
            return 1
        if not workloads:
            return 0
    seconds = estimate_seconds(tf, workloads, args.repeats, args.warmup)
    print(f"{len(workloads)} workload(s), {args.repeats} timed steps each: "
          f"about {_duration(seconds)} (a rough estimate)", flush=True)
    progress = _Progress(sum(1 + sum(_counts(w, args.repeats, args.warmup))
                             for w in workloads))
    rows = []
    try:
        for workload in workloads:
            progress.start(workload.name)
            rows.append(run_workload(tf, fasttape, workload, args.repeats,
                                     args.warmup, profiler, tick=progress.tick))
            progress.done(workload.name)
    finally:
        progress.close()
        tf_logger.removeFilter(retracing)
    print(format_table(rows))
    print("\nms per step, medians of alternating runs in one process (each round "
          "in a shuffled order), each "
          "± half its interquartile range.\nratio = fasttape / tf (< 1: "
          "fasttape faster; its ± from the per-step ratios).\ntf.fn, xla = "
          "TF's step traced by tf.function, without and with jit_compile=True "
          "(n/a: shapes change\nevery step, or it did not trace or compile); "
          "ft/fn = fasttape's eager step / the tf.function step.\nrec = recording overhead "
          "(forward under the tape minus the floor); held = bytes of forward "
          "tensors the\ntape keeps alive for the backward pass. ft backward: "
          "fasttape's backward passes replayed\nas compiled functions, or "
          "run op by op (eager).")
    per_op = format_per_op(rows)
    if per_op:
        print(per_op)
    graph_split = format_graph_split(rows)
    if graph_split:
        print("Against graph mode (each part over the tf.function step):")
        print(graph_split)
    bound = format_pass_bound(rows)
    if bound:
        print("With none of fasttape's own work (its step's calls of compiled "
              "backward passes alone, over TF's step):")
        print(bound)
    print()
    print(format_cache_table(rows))
    print("\nms; 1st = each tape's first step (fasttape's runs first); ft "
          "build = fasttape's first step that\nbuilt a compiled backward pass "
          "(- = none did); builds (passes built, or instantiated again after a "
          "kernel-cache clear) and build s\n(tracing + first calls): whole "
          "run; keys (distinct new pass keys) and hits (replayed passes / "
          "gradient calls): timed steps.\nmean = mean step time over the "
          "timed steps (builds included), ± half their interquartile range; "
          "off = fasttape with the compiled\n"
          "backward off (variable-shape workloads); m ratio = ft mean / tf "
          "mean; ft/off = ft mean / off mean.")
    if profiler is not None:
        print("(--profile: fasttape's steps ran under cProfile, where backward "
              "passes run op by op so\nthat each op type shows; their times "
              "include the profiler's cost.)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if profiler is not None:
        profiler.dump_stats(args.profile)
        print(f"cProfile stats of the fasttape steps written to {args.profile}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    if not all(r["grads_equal"] for r in rows):
        print("ERROR: gradients differ on: " + ", ".join(
            r["workload"] for r in rows if not r["grads_equal"]), file=sys.stderr)
        return 1
    return 0
