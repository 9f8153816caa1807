"""dp_gradient in a replica of a tf.distribute strategy (MirroredStrategy).

Each replica clips its own examples (_per_example.dp_gradient on its
shard); the clipped sums are summed across replicas with one all-reduce;
the noise is added once, by the first replica only, before the sum; and the
division is by the global number of microbatches. So every replica gets the
same gradient, equal to the one-device step on the whole batch (with the
same seed, the same noise).
"""

from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import reduce_util
from tensorflow.python.framework import constant_op
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_util
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import math_ops
from tensorflow.python.util import nest

from fasttape.backward import _per_example


def replica_context():
    """The replica context of a strategy with more than one replica, or None
    (no strategy, the default one, or cross-replica context)."""
    ctx = distribute_lib.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync <= 1:
        return None
    return ctx


def dp_gradient(ctx, tape, losses, sources, l2_norm_clip, noise_multiplier,
                num_microbatches, seed):
    # Checked on every replica before any collective: an error raised by one
    # replica alone would leave the others waiting in the all-reduce.
    if noise_multiplier < 0:
        raise ValueError(
            f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    replica = tensor_util.constant_value(ctx.replica_id_in_sync_group)
    if replica is None:
        # Which replica adds the noise must be known while tracing: guessing
        # would add it on none (no privacy) or on all (too much noise).
        raise NotImplementedError(
            "dp_gradient in a replica whose id is not a constant while "
            "tracing (a strategy other than MirroredStrategy?) is not "
            "supported: the noise must be added by exactly one replica")
    first = replica == 0
    local = _per_example.dp_gradient(
        tape, losses, sources, l2_norm_clip,
        noise_multiplier if first else 0.0, num_microbatches,
        seed if first else None)
    # its own microbatches (the batch, or num_microbatches, which
    # _per_example checked divides it)
    # (counted in float64: a float32 ratio 4/7 would round float64
    # gradients to float32's precision)
    if num_microbatches is not None:
        m_local = constant_op.constant(float(num_microbatches), "float64")
    elif losses.shape[0] is not None:
        m_local = constant_op.constant(float(losses.shape[0]), "float64")
    else:               # a batch unknown while tracing: the shard's, run time
        m_local = math_ops.cast(array_ops.shape(losses)[0], "float64")
    m_global = ctx.all_reduce(reduce_util.ReduceOp.SUM, m_local)
    flat = nest.flatten(local)
    # (dense: replica 0's noised table and the others' clipped rows, which
    # a replica without noise returns as IndexedSlices, reduce as one)
    present = [ops.convert_to_tensor(g) for g in flat if g is not None]
    # local is (clipped sum [+ noise]) / m_local: rescaled to / m_global
    scaled = [g * math_ops.cast(m_local / m_global, g.dtype) for g in present]
    summed = iter(ctx.all_reduce(reduce_util.ReduceOp.SUM, scaled)
                  if scaled else [])
    return nest.pack_sequence_as(
        local, [None if g is None else next(summed) for g in flat])
