"""Which inputs and outputs each op type's gradient function reads.

TF keeps alive, per recorded op, only the tensors its gradient uses (tables
generated from the gradient functions' source). fasttape derives the same
information at run time, once per op type, by reading the registered
function's source; an op whose function can't be analysed keeps everything.
"""

import ast
import inspect
import textwrap

from fasttape.gradients import _tf_compat  # noqa: F401  (first: refuses an unsupported TF)
from tensorflow.python.framework import ops

ALL = None  # "keep every input" (or output)
_saved_cache = {}


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
    result = (frozenset(), frozenset()) if fn is None else _analyse(fn)
    _saved_cache[op_type] = result
    return result


