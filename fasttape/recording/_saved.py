"""Which inputs and outputs each op type's gradient function reads.

TF keeps alive, per recorded op, only the tensors its gradient uses (tables
generated from the gradient functions' source). fasttape derives the same
information by reading the registered function's source, once per op type;
an op whose function can't be analysed keeps everything.

Reading a function's source costs 0.5-1 ms, paid inside a user's first step
by each new op type, so the reader's results for TF's own registered
gradients ship as data (``_saved_table``, one table per TF release, checked
against the reader by tests/test_saved_table.py). The table answers when it
has a table for the running release and an entry whose gradient function has
the same name as the registered one; everything else is read.

    python -m fasttape.recording._saved --regenerate

writes the running release's table (run it under each supported release).
"""

import ast
import inspect
import os
import textwrap

from fasttape.gradients import _tf_compat  # first: refuses an unsupported TF
from fasttape.recording import _saved_table
from tensorflow.python.framework import ops

ALL = None  # "keep every input" (or output)
_saved_cache = {}
# The shipped table of the running release: {op type: (gradient function's
# __qualname__, input indices, output indices)}, indices a tuple or None (ALL).
_table = _saved_table.TABLES.get("%d.%d" % _tf_compat.TF_VERSION, {})


def _union(a, b):
    if a is ALL or b is ALL:
        return ALL
    return a | b


def _analyse(fn, param=0, depth=0):
    """(input indices, output indices) that ``fn`` may read through its
    ``param``-th argument (the op), each a frozenset, or ALL when it can't be
    told. Conservative: any use of the op other than ``op.inputs[<int>]``,
    ``op.outputs[<int>]``, an attribute that holds no tensor, or passing it
    positionally to a module-level function (analysed in turn, a few levels
    deep) keeps everything."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ALL, ALL
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return ALL, ALL
    if len(fdef.args.args) <= param:
        return ALL, ALL
    op_name = fdef.args.args[param].arg
    parents = {}
    for node in ast.walk(fdef):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    used = {"inputs": frozenset(), "outputs": frozenset()}
    for node in ast.walk(fdef):
        if not (isinstance(node, ast.Name) and node.id == op_name):
            continue
        if isinstance(node.ctx, ast.Store):
            return ALL, ALL  # op rebound: give up
        parent = parents.get(node)
        if isinstance(parent, ast.Call) and node in parent.args and depth < 3:
            callee = fn.__globals__.get(parent.func.id) if isinstance(
                parent.func, ast.Name) else None
            if not inspect.isfunction(callee):
                return ALL, ALL
            sub_in, sub_out = _analyse(callee, parent.args.index(node), depth + 1)
            used["inputs"] = _union(used["inputs"], sub_in)
            used["outputs"] = _union(used["outputs"], sub_out)
            continue
        if not isinstance(parent, ast.Attribute):
            return ALL, ALL  # op passed along or stored: anything may be read
        attr = parent.attr
        if attr in ("inputs", "outputs"):
            grand = parents.get(parent)
            index = None
            if isinstance(grand, ast.Subscript) and grand.value is parent:
                sl = grand.slice
                if isinstance(sl, ast.Constant) and isinstance(sl.value, int):
                    index = sl.value
                elif (isinstance(sl, ast.UnaryOp) and isinstance(sl.op, ast.USub)
                      and isinstance(sl.operand, ast.Constant)
                      and isinstance(sl.operand.value, int)):
                    index = -sl.operand.value
            used[attr] = _union(used[attr], ALL if index is None
                                else frozenset({index}))
        elif attr in ("get_attr", "type", "name", "skip_input_indices",
                      "_get_attr_type", "_get_attr_bool", "_get_attr_int",
                      "node_def", "device", "graph", "_control_flow_context",
                      "_get_control_flow_context"):
            continue
        else:
            return ALL, ALL
    return used["inputs"], used["outputs"]


def saved_indices(op_type):
    """Cached (inputs, outputs) an op type's gradient reads; ALL = all."""
    try:
        return _saved_cache[op_type]
    except KeyError:
        pass
    try:
        fn = ops._gradient_registry.lookup(op_type)  # pylint: disable=protected-access
    except LookupError:
        fn = None
    if fn is None:
        result = (frozenset(), frozenset())
    else:
        result = _from_table(op_type, fn)
        if result is None:
            result = _analyse(fn)
    _saved_cache[op_type] = result
    return result


def _from_table(op_type, fn):
    """The shipped table's answer for ``op_type``, or None when it has none
    for the gradient function registered now."""
    entry = _table.get(op_type)
    if entry is None or entry[0] != getattr(fn, "__qualname__", None):
        return None
    return tuple(ALL if indices is None else frozenset(indices)
                 for indices in entry[1:])


def _as_data(indices):
    return None if indices is ALL else tuple(sorted(indices))


def read_table():
    """The running release's table as the source reader computes it: every op
    type whose registered gradient function ``import tensorflow`` installs."""
    import tensorflow  # noqa: F401  (every module that registers TF's gradients)
    table = {}
    for op_type in sorted(ops._gradient_registry.list()):  # pylint: disable=protected-access
        fn = ops._gradient_registry.lookup(op_type)  # pylint: disable=protected-access
        if fn is None:
            continue
        saved_in, saved_out = _analyse(fn)
        table[op_type] = (fn.__qualname__, _as_data(saved_in), _as_data(saved_out))
    return table


_HEADER = '''"""Which inputs and outputs each of TF's registered gradient functions
reads, per TF release: {op type: (function's __qualname__, input indices,
output indices)}, None meaning all; releases whose tables are equal share one.
Generated by ``python -m fasttape.recording._saved --regenerate`` (run under
each release); do not edit by hand. See fasttape/recording/_saved.py."""
'''


def _release_key(release):
    return tuple(int(part) for part in release.split("."))


def regenerate(path=_saved_table.__file__):
    """Rewrite ``path`` with the running release's table read afresh (the
    other releases' tables are kept)."""
    tables = dict(_saved_table.TABLES)
    release = "%d.%d" % _tf_compat.TF_VERSION
    tables[release] = read_table()
    shared = []   # [(table, [releases])], in release order
    for name in sorted(tables, key=_release_key):
        for table, names in shared:
            if table == tables[name]:
                names.append(name)
                break
        else:
            shared.append((tables[name], [name]))
    lines = [_HEADER]
    for table, names in shared:
        lines.append(f"\n_TF_{names[0].replace('.', '_')} = {{\n")
        lines.extend(f"    {op_type!r}: {entry!r},\n"
                     for op_type, entry in sorted(table.items()))
        lines.append("}\n")
    lines.append("\nTABLES = {\n")
    lines.extend(f"    {name!r}: _TF_{names[0].replace('.', '_')},\n"
                 for table, names in shared for name in names)
    lines.append("}\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(lines))
    os.replace(tmp, path)
    return release, len(tables[release])


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python -m fasttape.recording._saved --regenerate")
    print("TF %s: %d op types written" % regenerate())
