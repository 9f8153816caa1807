"""Differential fuzzing: random small programs (fuzz_programs.py) under
tf.GradientTape / tf.autodiff.ForwardAccumulator and under fasttape.

Each program runs RUNS times with new input values of the same shapes (so
fasttape's compiled backward is built, then replayed). Per run the two
results are compared as the parity suite does (``harness.assert_same``:
values within per-dtype tolerances, None positions, IndexedSlices against
dense, dtypes, exception types); where they differ, a float64
central-difference oracle judges (``fd.judge_results``). The test fails on
"fasttape wrong", on "inconclusive", on an exception-type difference and on
any "TF wrong" that is not a known one (README: "Where fasttape differs
from TF").

Profiles: the default (CI) is deterministic, ``CI_EXAMPLES`` programs;
``FASTTAPE_FUZZ=long`` draws ``FASTTAPE_FUZZ_EXAMPLES`` (default 3000)
random programs. ``FASTTAPE_FUZZ_REPORT=1`` prints the verdict counts and
the compiled-backward cache's counters (run pytest with ``-s``).
"""

import collections
import os

import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings

import fd
import fuzz_programs
import harness
from fasttape import _compiled
from harness import Raised

RUNS = 3
CI_EXAMPLES = 150     # draws; about 100 distinct programs (some draws repeat one)
LONG = os.environ.get("FASTTAPE_FUZZ") == "long"
REPORT = os.environ.get("FASTTAPE_FUZZ_REPORT") == "1"

_HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
           HealthCheck.data_too_large, HealthCheck.filter_too_much]
if LONG:
    PROFILE = settings(max_examples=int(os.environ.get(
        "FASTTAPE_FUZZ_EXAMPLES", "3000")), deadline=None, database=None,
        suppress_health_check=_HEALTH)
else:
    PROFILE = settings(max_examples=CI_EXAMPLES, derandomize=True,
                       database=None, deadline=None,
                       suppress_health_check=_HEALTH)

COUNTS = collections.Counter()     # verdict -> runs
PROGRAMS = collections.Counter()   # distinct programs run / repeats skipped
COMPILED = collections.Counter()   # fasttape's compiled-backward counters
_PASSED = set()                    # programs already run and passed

FAILING = ("fasttape wrong", "inconclusive", "exception types differ",
           "TF wrong (not a known difference)")
KNOWN_TF_WRONG = "TF wrong (known: Variable into tf.function under an accumulator)"


@pytest.fixture
def compiled_cache(monkeypatch):
    """The compiled-backward cache, empty, in auto mode, and keeping
    compiled passes that are slower than the eager ones (these programs are
    small), so that they are built and replayed; its counters are kept."""
    monkeypatch.setattr(_compiled.CACHE, "keep_faster", False)
    _compiled.CACHE.clear()
    previous = _compiled.set_mode("auto")
    yield
    _compiled.set_mode(previous)
    COMPILED.update(_compiled.CACHE.stats)
    _compiled.CACHE.clear()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if REPORT:
        print("\n" + summary())


def summary():
    lines = [f"fuzz: {PROGRAMS['run']} programs x {RUNS} runs "
             f"({PROGRAMS['repeat']} repeated draws skipped)"]
    for verdict, n in sorted(COUNTS.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:6d}  {verdict}")
    eager = sum(COMPILED[k] for k in ("eager", "skipped", "failed", "slower"))
    lines.append(f"compiled backward: {COMPILED['built']} built, "
                 f"{COMPILED['replayed']} replayed, {eager} passes eager "
                 f"({dict(sorted(COMPILED.items()))})")
    return "\n".join(lines)


def _known_tf_wrong(program, expected):
    """TF raises ValueError ("variable without handle data") for a
    ForwardAccumulator whose Variable primal is passed into a tf.function
    (README; test_tf_differences.py)."""
    if not (isinstance(expected, Raised) and isinstance(expected.exc, ValueError)
            and "handle data" in str(expected.exc)):
        return False
    if not fuzz_programs._forward(program.mode):  # pylint: disable=protected-access
        return False
    primal_vars = {i for i in program.sources
                   if program.values[i].kind == "var"}
    return any(isinstance(v, fuzz_programs.Node) and v.wrap == "function"
               and primal_vars.intersection(v.args) for v in program.values)


def verdict_of(program, runner, run, expected, actual):
    if isinstance(expected, Raised) and isinstance(actual, Raised):
        if type(expected.exc) is type(actual.exc):
            return f"both raise {type(expected.exc).__name__}"
        return "exception types differ"
    rtol, atol = runner.tolerance()
    verdict = fd.judge_results(expected, actual, lambda: runner.oracle(run),
                               rtol, atol, none_as_zeros=True)
    if verdict == "TF wrong":
        return (KNOWN_TF_WRONG if _known_tf_wrong(program, expected)
                else "TF wrong (not a known difference)")
    return verdict


def _describe(expected, actual):
    try:
        harness.assert_same(expected, actual)
    except AssertionError as e:
        return str(e)
    return ""


def check(program):
    """Run one program RUNS times under both implementations; returns the
    failures (empty: it passed)."""
    runner = fuzz_programs.Runner(program)
    failures = []
    with pytest.MonkeyPatch.context() as mp:
        if fuzz_programs._forward(program.mode):  # pylint: disable=protected-access
            # TF's JVP traces as in a fresh process, whatever ran before
            # (conftest's fresh_tf_jvp_traces, once per program)
            harness.fresh_tf_jvp_trace_state(mp, {})
        for run in range(RUNS):
            case = runner.case(run)
            expected, actual = fd.run(case, "tf"), fd.run(case, "fasttape")
            verdict = verdict_of(program, runner, run, expected, actual)
            COUNTS[verdict] += 1
            if verdict in FAILING:
                oracle = (None if verdict == "exception types differ"
                          else runner.oracle(run))
                failures.append(
                    f"run {run}: {verdict}: {_describe(expected, actual)}\n"
                    f"  tf:       {expected!r}\n  fasttape: {actual!r}\n"
                    f"  oracle:   {oracle!r}")
    return failures


@pytest.mark.usefixtures("fresh_tf_jvp_traces", "compiled_cache")
@PROFILE
@given(program=fuzz_programs.programs())
def test_fuzz_tf_against_fasttape(program):
    if program in _PASSED:       # another draw gave the same program
        PROGRAMS["repeat"] += 1
        return
    PROGRAMS["run"] += 1
    failures = check(program)
    assert not failures, f"{program!r}\n" + "\n".join(failures)
    _PASSED.add(program)


# -- what the fuzzer found ----------------------------------------------------------

def test_unwatched_source_with_wrong_seed():
    """An unwatched constant passed as a source, with a seed that does not
    fit the target: TF runs the Add's gradient for it (it is a source) and
    raises InvalidArgumentError; fasttape once skipped that op and returned
    [ones(2), None]. Repeated, so the compiled cache sees it too."""
    def case(FA, GT):
        x = tf.constant([0.5, -1.0])
        c = tf.constant(2.0)
        with GT() as t:
            t.watch(x)
            y = c + x
        return t.gradient(y, [x, c], output_gradients=tf.ones([1, 2]))

    for _ in range(RUNS):
        expected = harness.compare(fd.run(case, "tf"), fd.run(case, "fasttape"))
        assert isinstance(expected, Raised) and isinstance(
            expected.exc, tf.errors.InvalidArgumentError), expected


def test_the_oracle_agrees_with_tf_where_both_implementations_agree():
    """The judge is only as good as its oracle: on a fixed sample of
    programs, wherever TF and fasttape agree and TF succeeded, the
    finite-difference oracle gives their answer."""
    checked = collections.Counter()

    @settings(max_examples=25, derandomize=True, database=None, deadline=None,
              suppress_health_check=_HEALTH)
    @given(program=fuzz_programs.programs())
    def sample(program):
        runner = fuzz_programs.Runner(program)
        case = runner.case(0)
        with pytest.MonkeyPatch.context() as mp:
            harness.fresh_tf_jvp_trace_state(mp, {})
            expected = fd.run(case, "tf")
        oracle = runner.oracle(0)
        if isinstance(expected, Raised) or oracle is None:
            return
        rtol, atol = runner.tolerance()
        assert fd.matches(expected, oracle, rtol, atol, none_as_zeros=True), (
            f"{program!r}\n  tf: {expected!r}\n  oracle: {oracle!r}")
        checked[program.mode] += 1

    sample()
    assert sum(checked.values()) >= 15, checked


def test_programs_print_as_readable_code():
    program = fuzz_programs.Program(
        dtype="float32",
        values=(fuzz_programs.Input("var", (2, 3)),
                fuzz_programs.Input("const", (3,), watched=False),
                fuzz_programs.Node("gather", (0,), ((1, 1), 0)),
                fuzz_programs.Node("mul", (2, 1), wrap="function")),
        mode="gradient", targets=(3,), sources=(0, 1), seeds="wrong_shape:grow")
    assert repr(program) == (
        "Program(gradient, float32, seed=0):\n"
        "  v0 = var float32[2, 3]\n"
        "  v1 = const float32[3]  (unwatched)\n"
        "  v2 = gather(v0, (1, 1), 0)\n"
        "  v3 = mul(v2, v1)  [function]\n"
        "  gradient: targets [v3], sources [v0, v1], "
        "output_gradients=wrong_shape:grow, unconnected=none")
    runner = fuzz_programs.Runner(program)
    assert runner.shapes()[3] == (2, 3)
    assert runner.oracle(0) is None          # a wrong seed has no oracle
    result = fd.run(runner.case(0), "fasttape")
    assert isinstance(result, Raised), result
