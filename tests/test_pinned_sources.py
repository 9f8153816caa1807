"""The root conftest pins each test module's source in linecache as it was
imported: AutoGraph, converting a tf.function first traced late in a run,
reads the source there, and a file edited on disk mid-run handed it the
lines of another def (an AutoGraph TypeError in a test that never failed
again)."""
import linecache
import os
import textwrap

import pytest
import tensorflow as tf  # noqa: F401  (imported once: the inner runs drop
                         # the modules they import, and TF imported twice aborts)

pytest_plugins = ["pytester"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two tests in one file: the first edits the file on disk (six lines
# added at its top, as an editor or a checkout would), the second traces a
# module-level tf.function defined after a def of another signature, which
# the six lines move to the tf.function's old line.
EDITED = textwrap.dedent("""\
    import tensorflow as tf


    def other(a, b, c):
        return a




    @tf.function
    def centered(h):
        return h - tf.reduce_mean(h, 0)


    def test_edit_this_file():
        with open(__file__) as f:
            source = f.read()
        with open(__file__, "w") as f:
            f.write("# a line added while the suite runs\\n" * 6 + source)


    def test_trace_after_the_edit():
        assert centered(tf.ones([2, 3])).shape == [2, 3]
    """)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_tf_function_traced_after_its_file_is_edited(pytester, monkeypatch,
                                                       pinned):
    # (the inner run's pin is undone after)
    monkeypatch.setattr(linecache, "updatecache", linecache.updatecache)
    assert EDITED.splitlines()[9] == "@tf.function"     # line 10: 4 + 6
    if pinned:
        pytester.makeconftest(textwrap.dedent(f"""\
            import importlib.util
            spec = importlib.util.spec_from_file_location(
                "_fasttape_root_conftest", {os.path.join(ROOT, "conftest.py")!r})
            root = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(root)
            pytest_make_collect_report = root.pytest_make_collect_report
            """))
    # (each case's own code: AutoGraph's cache of conversions, keyed by
    # code objects, which compare equal across files, would hand the
    # second case the first's)
    pytester.makepyfile(test_edited=EDITED.replace(
        "reduce_mean(h, 0)", f"reduce_mean(h, 0) * {1 + pinned}"))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    if pinned:
        result.assert_outcomes(passed=2)
    else:
        # (without the pin: AutoGraph converts `other` and calls it with h)
        result.assert_outcomes(passed=1, failed=1)
        assert "TypeError" in result.stdout.str()
