"""fasttape.profile(): where the backward pass spends its time, per op type.

    with fasttape.profile() as prof:
        grads = tape.gradient(loss, model.trainable_variables)
    print(prof)              # a table: op type, calls, total ms, mean us
    prof.stats               # {op_type: (calls, seconds)}

Under cProfile (``python -m fasttape bench --profile FILE`` or any cProfile
run) the backward pass also appears as one function per op type,
``backward_<OpType>``.
"""

import contextlib

from fasttape.recording import _recording


class BackwardProfile:
    """Calls and seconds spent in each op type's backward function."""

    def __init__(self):
        self._raw = {}

    @property
    def stats(self):
        return {k: (v[0], v[1]) for k, v in self._raw.items()}

    @property
    def total_seconds(self):
        return sum(v[1] for v in self._raw.values())

    def table(self, sort_by="total"):
        rows = sorted(self._raw.items(),
                      key=(lambda kv: -kv[1][1]) if sort_by == "total"
                      else (lambda kv: -kv[1][0]))
        lines = [f"{'op type':<40} {'calls':>8} {'total ms':>10} {'mean us':>9}"]
        for op_type, (count, seconds) in rows:
            lines.append(f"{op_type:<40} {count:>8} {seconds * 1e3:>10.3f} "
                         f"{seconds / count * 1e6:>9.1f}")
        lines.append(f"{'total':<40} {sum(v[0] for v in self._raw.values()):>8} "
                     f"{self.total_seconds * 1e3:>10.3f}")
        return "\n".join(lines)

    def __str__(self):
        return self.table()


@contextlib.contextmanager
def profile():
    """Profile every fasttape backward pass run inside the block."""
    prof = BackwardProfile()
    vspace = _recording.VSPACE
    previous = vspace.profile_stats
    vspace.profile_stats = prof._raw  # pylint: disable=protected-access
    try:
        yield prof
    finally:
        vspace.profile_stats = previous
