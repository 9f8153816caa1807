import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

from harness import fresh_tf_jvp_trace_state  # noqa: E402


@pytest.fixture
def fresh_tf_jvp_traces(monkeypatch):
    """TF's JVPs depend on history: after ``_TRACE_COUNT_LIMIT`` (32) traces
    of an op in a process TF traces its JVPs with relaxed shapes, and the
    exact-shape config then finds those relaxed traces in the cache both
    share; there a scalar tangent no longer broadcasts (``InvalidArgumentError``
    from a Reshape instead of a JVP, or instead of the ``ValueError`` a
    wrong-shaped tangent gives). The reference here is TF in a fresh process,
    whatever ran before in this one; the relaxed TF is tested on its own."""
    fresh_tf_jvp_trace_state(monkeypatch, {})


def pytest_sessionfinish(session):
    """An xdist worker hands its names (see below) to the controller."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        import harness  # pylint: disable=import-outside-toplevel
        output["tf_nondeterministic"] = list(harness.TF_NONDETERMINISTIC)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # pylint: disable=unused-argument
    """(xdist's controller) A worker's names, gathered for the summary."""
    import harness  # pylint: disable=import-outside-toplevel
    harness.TF_NONDETERMINISTIC.extend(
        getattr(node, "workeroutput", {}).get("tf_nondeterministic", ()))


def pytest_terminal_summary(terminalreporter):
    """Name the bit-exact comparisons that fell back to tolerances because
    TF's own tape gave different last bits run to run."""
    import harness  # pylint: disable=import-outside-toplevel
    if harness.TF_NONDETERMINISTIC:
        terminalreporter.write_line(
            "bit-exact parity: TF's own results differ run to run in "
            f"{len(harness.TF_NONDETERMINISTIC)} comparisons (tolerances "
            "applied): " + ", ".join(sorted(set(harness.TF_NONDETERMINISTIC))))
