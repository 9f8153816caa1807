"""Mutation check of the core tests (run by hand; pytest does not collect it).

    .venv/bin/python tests/mutate_core.py            # every mutant
    .venv/bin/python tests/mutate_core.py M3 M7      # some

Each mutant is fasttape/_core.pyx with one small change. It is built in a
scratch copy of the sources (the working tree, its _core.pyx and its .so are
never touched) and the core tests load it through FASTTAPE_CORE_SO. A mutant
is killed when some test fails; the run ends by building the unmutated
source the same way and checking that every test passes.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = set()
TESTS = ["tests/test_core.py", "tests/test_core_forward.py", "tests/test_core_scale.py"]

_ORDER_HELPER = '''

def _mutant_order(n):
    return sorted(range(n), key=lambda i: hash(str(i)))
'''

# name, what it breaks, old text, new text, expected occurrences of old
MUTANTS = [
    ("M1", "usage count decremented by 2",
     "uit = usage_counts.find(tid)\n                if uit == usage_counts.end():\n                    continue\n                deref(uit).second = deref(uit).second - 1",
     "uit = usage_counts.find(tid)\n                if uit == usage_counts.end():\n                    continue\n                deref(uit).second = deref(uit).second - 2", 1),
    ("M2", "op_missing_tensor decremented by 2",
     "uit = op_missing_tensor.find(producer)\n                if uit != op_missing_tensor.end():\n                    deref(uit).second = deref(uit).second - 1",
     "uit = op_missing_tensor.find(producer)\n                if uit != op_missing_tensor.end():\n                    deref(uit).second = deref(uit).second - 2", 1),
    ("M3", "pending gradients not summed: only pending[0] used",
     "                else:\n                    grad = vspace.aggregate(pending)",
     "                else:\n                    grad = pending[0]", 1),
    ("M4", "final gradient of a source: only pending[0]",
     "                if len(pending) > 1:\n                    pending[:] = [vspace.aggregate(pending)]",
     "                if len(pending) > 1:\n                    pending[:] = [pending[0]]", 1),
    ("M5", "early aggregation ignores element_size (4 bytes assumed)",
     "vspace.element_size(pending[0]))", "4)", 1),
    ("M6", "early aggregation never happens",
     "if len(pending) * size > MIN_AGGREGATE_BYTES:", "if False:", 1),
    ("M7", "non-persistent tape keeps used payloads",
     "                if not keep:\n                    entry.payload = None\n                in_grads = vspace.call_backward",
     "                in_grads = vspace.call_backward", 1),
    ("M8", "no pruning: reachable ops that read no source are called",
     "            if useful[op_id]:\n                ops[op_id]", "            if True:\n                ops[op_id]", 1),
    ("M9", "unneeded_indices always empty",
     "if needed.count(entry.input_ids[k]) == 0:", "if False:", 1),
    ("M10", "missing output gradients not filled with zeros",
     "out_grads[k] = vspace.zeros_like(entry.output_meta[k])", "out_grads[k] = None", 1),
    ("M11", "none_ok_indices ignored",
     "if accepts is None or k not in accepts:", "if True:", 1),
    ("M12", "sources_that_are_targets ignored",
     "elif tid in sources_that_are_targets:", "elif False:", 1),
    ("M13", "reachability walk stops at sources",
     "                if seen.count(tid) == 0:\n                    seen.insert(tid)",
     "                if sources_set.count(tid) == 0 and seen.count(tid) == 0:\n                    seen.insert(tid)", 1),
    ("M14", "delete_trace does not cascade to inputs",
     "                stack.push_back(out_id)", "                pass", 1),
    ("M15", "delete_trace releases an op whose other output lives",
     "output_alive = True", "output_alive = False", 1),
    ("M16", "export_trace output offsets wrong",
     "out_off[k] = po", "out_off[k] = pi", 1),
    ("M17", "record_operation: first writer wins",
     "self.tensor_tape[tid] = op_id", "self.tensor_tape.insert((tid, op_id))", 1),
    ("M18", "watch twice overwrites the tangent",
     "self.accumulated[tensor_id] = self.vspace.aggregate([tangent, existing])",
     "self.accumulated[tensor_id] = tangent", 1),
    ("M19", "re-accumulated output: last tangent wins",
     "if t is not None and tid not in acc:", "if t is not None:", 1),
    ("M20", "no zero tangents for unwatched trainable inputs",
     "t = self.vspace.zeros_like(input_meta[i])", "t = None", 1),
    ("M21", "fallback transposes with ones instead of the input tangents",
     "used.append(in_tangents[k])", "used.append(None)", 1),
    ("M22", "accumulator should_record does not ask the inner tape",
     "return (<GradientTapeCore>top[0]).should_record(input_ids, trainable)",
     "return True", 1),
    ("M23", "call_state[-1] with wraparound off (the original bug)",
     "self.call_state[len(self.call_state) - 1]", "self.call_state[-1]", 4),
    ("M24", "accumulator not busy while running a rule",
     "self.call_state.append([None, True])", "self.call_state.append([None, False])", 1),
    ("M25", "batched fallback uses example 0 for every example",
     "[None if s is None else s[b] for s in split]", "[None if s is None else s[0] for s in split]", 1),
    ("M26", "non-persistent tape never marked consumed",
     "        if not keep:\n            self.consumed = True",
     "        if not keep:\n            pass", 1),
    ("M27", "pending gradients summed in a hash-seed dependent order",
     "                else:\n                    grad = vspace.aggregate(pending)",
     "                else:\n                    grad = vspace.aggregate([pending[i] for i in _mutant_order(len(pending))])", 1),
    ("M29", "batched fallback unbatches made-up zeros of unwatched inputs",
     "                    own_tangents if self.use_batch else in_tangents)",
     "                    in_tangents)", 1),
    ("M30", "release() leaves a retained trace in place",
     "            self.consumed = True\n            self._release_all()",
     "            self.consumed = True", 1),
    ("M31", "retain ignored on a non-persistent tape",
     "cdef bint keep = self.persistent or retain", "cdef bint keep = self.persistent", 1),
    ("M32", "batched forward rules get unbatched zeros for inputs without tangent",
     "op_type, payload, own_tangents if self.use_batch else in_tangents,",
     "op_type, payload, in_tangents,", 1),
    ("M28", "several initial ops by op id, not in TF's hash-map order",
     "        if op_stack.size() > 1:\n            self._tf_order(targets, op_stack)",
     "        if False:\n            self._tf_order(targets, op_stack)", 1),
    ("M33", "ready ops run last ready first (a stack, not TF's queue)",
     "            op_id = op_stack[head]\n            head += 1",
     "            op_id = op_stack.back()\n            op_stack.pop_back()", 1),
]


def build(src_text, scratch):
    (scratch / "fasttape" / "_core.pyx").write_text(src_text)
    for so in (scratch / "fasttape").glob("_core.*.so"):
        so.unlink()
    res = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=scratch, capture_output=True, text=True,
        env=dict(os.environ, FASTTAPE_BUILD="release"))
    sos = list((scratch / "fasttape").glob("_core.*.so"))
    if res.returncode != 0 or not sos:
        raise RuntimeError(f"build failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return sos[0]


def run_tests(so, timeout=300):
    env = dict(os.environ, FASTTAPE_CORE_SO=str(so))
    try:
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--tb=no", "-rfE",
             "-p", "no:cacheprovider", *TESTS],
            cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "timeout"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", res.stdout, re.M)
    tail = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-300:]
    if res.returncode not in (0, 1) and not failed:
        return ["<crash>"], f"rc={res.returncode} {tail}"
    return failed, tail


def main(names):
    pristine = (ROOT / "fasttape" / "_core.pyx").read_text()
    scratch = Path(tempfile.mkdtemp(prefix="fasttape-mut-"))
    try:
        (scratch / "fasttape").mkdir()
        for f in ("setup.py", "pyproject.toml", "README.md"):
            if (ROOT / f).exists():
                shutil.copy(ROOT / f, scratch / f)
        for pattern in ("*.pyx", "*.pxd", "*.pxi", "*.h"):  # setup.py may build more
            for f in (ROOT / "fasttape").rglob(pattern):   # (in subpackages too)
                dest = scratch / "fasttape" / f.relative_to(ROOT / "fasttape")
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, dest)
        for d in [scratch / "fasttape", *(scratch / "fasttape").rglob("*")]:
            if d.is_dir():
                (d / "__init__.py").write_text("")
        survived = []
        for name, what, old, new, count in MUTANTS:
            if names and name not in names:
                continue
            n = pristine.count(old)
            if n != count:
                print(f"{name}: SKIPPED, pattern found {n} times, expected {count}")
                continue
            text = pristine.replace(old, new)
            if name == "M27":
                text += _ORDER_HELPER
            t0 = time.time()
            so = build(text, scratch)
            failed, tail = run_tests(so)
            dt = time.time() - t0
            if failed is None:
                print(f"{name} ({what}): KILLED by timeout [{dt:.0f}s]")
            elif failed:
                short = [f.split("::", 1)[-1] for f in failed]
                print(f"{name} ({what}): KILLED by {len(failed)}: {', '.join(short[:6])}"
                      f"{' ...' if len(short) > 6 else ''} [{dt:.0f}s]")
            else:
                if name not in EQUIVALENT:
                    survived.append(name)
                print(f"{name} ({what}): SURVIVED ({tail}) [{dt:.0f}s]")
            sys.stdout.flush()
        so = build(pristine, scratch)
        failed, tail = run_tests(so)
        print(f"unmutated source: {'OK' if failed == [] else 'FAILING ' + str(failed)} ({tail})")
        print(f"survivors: {survived or 'none'}")
        return 1 if survived or failed else 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(set(sys.argv[1:])))
