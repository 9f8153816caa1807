"""dp_gradient in a replica of a tf.distribute strategy (MirroredStrategy).

Each replica clips its own examples (_per_example.dp_gradient on its
shard, undivided); the clipped sums are summed across replicas with one
all-reduce; the noise is added once, by the first replica only, before the
sum; and the sum is divided by the global number of microbatches (summed
by a second all-reduce). So every replica gets the same gradient, equal to
the one-device step on the whole batch (with the same seed, the same
noise). An empty shard (a global batch smaller than the replicas) adds
zeros and no microbatch.
"""

from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import reduce_util
from tensorflow.python.eager import context
from tensorflow.python.framework import constant_op
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_util
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import control_flow_assert
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
    # (each replica's errors come here, before any collective: raised by
    # one replica alone, they would leave the others waiting in it)
    local = _per_example.dp_gradient(
        tape, losses, sources, l2_norm_clip,
        noise_multiplier if first else 0.0, num_microbatches,
        seed if first else None, divide=False)
    m_global = ctx.all_reduce(reduce_util.ReduceOp.SUM,
                              _microbatches(losses, num_microbatches))
    flat = nest.flatten(local)
    # (dense: replica 0's noised table and the others' clipped rows, which
    # a replica without noise returns as IndexedSlices, reduce as one)
    present = [ops.convert_to_tensor(g) for g in flat if g is not None]
    summed = ctx.all_reduce(reduce_util.ReduceOp.SUM, present) if present else []
    # (no example on any replica: one device's error for an empty batch)
    if context.executing_eagerly():
        if not m_global.numpy() > 0:      # (the same on every replica)
            raise _per_example.IndivisibleBatchError(
                None, None, _per_example.EMPTY_BATCH)
    else:
        check = control_flow_assert.Assert(math_ops.greater(m_global, 0),
                                           [_per_example.EMPTY_BATCH])
        with ops.control_dependencies([check]):
            m_global = array_ops.identity(m_global)
    divided = iter([g / math_ops.cast(m_global, g.dtype) for g in summed])
    return nest.pack_sequence_as(
        local, [None if g is None else next(divided) for g in flat])


def _microbatches(losses, num_microbatches):
    """The number of microbatches of a replica's losses (float64: a float32
    count would round the division of float64 gradients by their sum): its
    examples, or num_microbatches (which _per_example checked divides
    them); none for an empty shard. Read at run time where the shard's
    size is unknown while tracing."""
    batch = losses.shape[0]
    if batch is not None:
        return constant_op.constant(
            float(0 if batch == 0 else num_microbatches or batch), "float64")
    n = array_ops.shape(losses)[0]
    if num_microbatches is not None:
        n = math_ops.minimum(n, 1) * num_microbatches
    return math_ops.cast(n, "float64")
