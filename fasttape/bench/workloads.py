"""The bench's workloads: each one a model step run with no tape (the
floor) and under a tape (TF's or fasttape's), and what it measures."""

import numpy as np


class Workload:
    """name, and ``make(tf)`` -> (forward, record): ``forward()`` runs the
    model with no tape (the floor); ``record(impl)`` runs it under ``impl``'s
    tape or accumulator and returns ``finish``, a function that computes and
    returns the gradients (or JVPs). ``impl`` has ``GradientTape`` and
    ``ForwardAccumulator`` (TF's or fasttape's)."""

    def __init__(self, name, make, description, max_repeats=None,
                 variable=False, ops_per_step=None):
        self.name = name
        self.make = make
        self.description = description
        self.max_repeats = max_repeats
        # What it measures besides the step: with ops_per_step, each tape's
        # recording overhead per recorded op (rec / ops_per_step).
        # (Timed over PER_OP_STEPS steps at least.)
        self.ops_per_step = ops_per_step
        # Shapes change from step to step: timed from the first step (no
        # warm-up), VARIABLE_STEPS steps at least, judged by the mean (total)
        # time, builds of compiled passes included, and also run with the
        # compiled backward off.
        self.variable = variable


def _grad_case(forward, sources, watch=()):
    def record(impl):
        with impl.GradientTape() as tape:
            for w in watch:
                tape.watch(w)
            loss = forward()
        return lambda: tape.gradient(loss, sources)
    return forward, record


def _chain(tf):
    x = tf.constant([[0.5, 0.6], [0.7, 0.8]])
    y0 = tf.constant([[0.1, 0.2], [0.3, 0.4]])

    def forward():
        y = y0
        for _ in range(200):
            y = tf.sin(y) * x
        return y

    return _grad_case(forward, x, watch=[x])


RECORDING_OPS = 400


def _sin_chain(tf):
    x = tf.constant([[0.1, 0.2], [0.3, 0.4]])

    def forward():
        y = x
        for _ in range(RECORDING_OPS):
            y = tf.sin(y)
        return y

    return x, forward


def _recording(tf):
    """The recording microbenchmark: a chain of tf.sin on 2x2, where the
    kernels cost least and what a tape adds per op shows most. Its rec tf /
    rec ft columns, divided by RECORDING_OPS, are each tape's recording
    cost per op above the no-tape floor."""
    x, forward = _sin_chain(tf)
    return _grad_case(forward, x, watch=[x])


def _recording_dying(tf):
    """The same chain recorded and dropped with no gradient: the tape and
    what it recorded are freed inside the recording arm, so its rec columns
    count forgetting the ops as well as recording them."""
    x, forward = _sin_chain(tf)

    def record(impl):
        with impl.GradientTape() as tape:
            tape.watch(x)
            forward()
        return _nothing

    return forward, record


def _nothing():
    return None


def _dense_stack(tf, sizes, batch, seed):
    rng = np.random.default_rng(seed)
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        w = tf.Variable(rng.normal(0, 1 / np.sqrt(n_in), (n_in, n_out)).astype("float32"))
        b = tf.Variable(np.zeros(n_out, "float32"))
        params += [w, b]
    x = tf.constant(rng.normal(size=(batch, sizes[0])).astype("float32"))
    labels = tf.constant(rng.integers(0, sizes[-1], batch))

    def forward(h=x, labels=labels):
        for i in range(0, len(params), 2):
            h = tf.nn.bias_add(tf.matmul(h, params[i]), params[i + 1])
            if i + 2 < len(params):
                h = tf.nn.relu(h)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, h))

    forward.params = params

    return _grad_case(forward, params)


def _mlp_small(tf):
    return _dense_stack(tf, [64, 64, 64, 64], 32, 0)


def _mlp_large(tf):
    return _dense_stack(tf, [784, 256, 256, 10], 64, 1)


def _embedding(tf):
    rng = np.random.default_rng(2)
    table = tf.Variable(rng.normal(size=(1000, 32)).astype("float32"))
    w = tf.Variable(rng.normal(size=(32, 1)).astype("float32"))
    ids = tf.constant(rng.integers(0, 1000, (64, 8)))

    def forward():
        e = tf.reduce_mean(tf.gather(table, ids), axis=1)
        return tf.reduce_mean(tf.square(tf.matmul(e, w)))

    return _grad_case(forward, [table, w])


def _rnn_cell(tf, seed, max_length):
    """The tanh RNN cell's parameters, and ``run(length)``: the loss after
    ``length`` steps (at most ``max_length``) over a batch of 8."""
    rng = np.random.default_rng(seed)
    wx = tf.Variable(rng.normal(0, 0.3, (16, 32)).astype("float32"))
    wh = tf.Variable(rng.normal(0, 0.3, (32, 32)).astype("float32"))
    b = tf.Variable(np.zeros(32, "float32"))
    xs = tf.constant(rng.normal(size=(max_length, 8, 16)).astype("float32"))

    def run(length):
        h = tf.zeros((8, 32))
        for t in range(length):
            h = tf.tanh(tf.matmul(xs[t], wx) + tf.matmul(h, wh) + b)
        return tf.reduce_sum(h * h)

    return [wx, wh, b], run


def _rnn(tf):
    params, run = _rnn_cell(tf, 3, 40)
    return _grad_case(lambda: run(40), params)


def _cnn(tf):
    rng = np.random.default_rng(4)
    k1 = tf.Variable(rng.normal(0, 0.2, (3, 3, 3, 8)).astype("float32"))
    k2 = tf.Variable(rng.normal(0, 0.2, (3, 3, 8, 16)).astype("float32"))
    w = tf.Variable(rng.normal(0, 0.1, (16 * 4 * 4, 10)).astype("float32"))
    x = tf.constant(rng.normal(size=(16, 16, 16, 3)).astype("float32"))
    labels = tf.constant(rng.integers(0, 10, 16))

    def forward():
        h = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME"))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h = tf.nn.relu(tf.nn.conv2d(h, k2, 1, "SAME"))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        logits = tf.matmul(tf.reshape(h, (16, -1)), w)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    return _grad_case(forward, [k1, k2, w])


def _matmul(tf):
    rng = np.random.default_rng(5)
    a = tf.Variable(rng.normal(size=(512, 512)).astype("float32"))
    b = tf.constant(rng.normal(size=(512, 512)).astype("float32") / 20)

    def forward():
        h = a
        for _ in range(4):
            h = tf.matmul(h, b)
        return tf.reduce_sum(h)

    return _grad_case(forward, a)


def _hvp(tf):
    rng = np.random.default_rng(6)
    x = tf.Variable(rng.normal(size=(32,)).astype("float32"))
    m = tf.constant(rng.normal(size=(32, 32)).astype("float32") / 6)
    v = tf.constant(rng.normal(size=(32,)).astype("float32"))

    def f():
        h = tf.tanh(tf.linalg.matvec(m, x))
        return tf.reduce_sum(tf.sin(h) * h)

    def record(impl):
        # forward-over-reverse Hessian-vector product
        with impl.ForwardAccumulator(x, v) as acc:
            with impl.GradientTape() as tape:
                y = f()
            g = tape.gradient(y, x)
        return lambda: acc.jvp(g)

    return f, record


def _jvp(tf):
    forward, _ = _mlp_small(tf)
    params = forward.params
    rng = np.random.default_rng(7)
    tangents = [tf.constant(rng.normal(size=p.shape).astype("float32"))
                for p in params]

    def record(impl):
        with impl.ForwardAccumulator(params, tangents) as acc:
            loss = forward()
        return lambda: acc.jvp(loss)

    return forward, record


def _jacobian(tf):
    rng = np.random.default_rng(8)
    x = tf.constant(rng.normal(size=(1, 16)).astype("float32"))
    w1 = tf.Variable(rng.normal(0, 0.3, (16, 64)).astype("float32"))
    w2 = tf.Variable(rng.normal(0, 0.3, (64, 32)).astype("float32"))

    def forward():
        return tf.tanh(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2))

    def record(impl):
        with impl.GradientTape() as tape:
            tape.watch(x)
            y = forward()
        return lambda: tape.jacobian(y, x)

    return forward, record


# -- shapes that change from step to step ---------------------------------------

# As many steps as the compiled-backward cache expects a steady key to be
# used (_compiled.HORIZON): it builds a pass when the pass pays back over
# that many calls, so a shorter window would count builds and not what
# they save.
VARIABLE_STEPS = 200

# The per-op recording workloads' timed steps, at least: what they measure
# (the tape's cost above the floor, about 0.6 ms a step) is as wide as the
# interquartile range of 31 such steps, so a median of 31 read 0.88 to 1.27
# of TF's from run to run for the same code; each step costs a few ms.
PER_OP_STEPS = 101


class _Sequence:
    """The values a variable workload's steps go through: the n-th call by
    each caller (``impl``, or None for the floor) gets the n-th value, so
    TF's and fasttape's steps see the same shapes in the same order."""

    def __init__(self, values):
        self.values = list(values)
        self.calls = {}

    def next(self, caller):
        n = self.calls.get(id(caller), 0)
        self.calls[id(caller)] = n + 1
        return self.values[n % len(self.values)]


def _lengths(seed, low, high, distinct=20, steps=VARIABLE_STEPS):
    """Sequence lengths as text gives them: ``distinct`` lengths between
    ``low`` and ``high``, drawn with Zipf-like weights (a few common
    lengths, a long tail), ``steps`` draws."""
    rng = np.random.default_rng(seed)
    choices = np.sort(rng.choice(np.arange(low, high + 1), distinct,
                                 replace=False))
    weights = 1.0 / np.arange(1, distinct + 1)
    rng.shuffle(weights)
    return [int(n) for n in rng.choice(choices, steps, p=weights / weights.sum())]


def _variable_case(forward_at, sequence, sources):
    """A gradient workload whose n-th step runs ``forward_at(value)`` for
    the n-th value of ``sequence``."""
    def forward():
        return forward_at(sequence.next(None))

    def record(impl):
        value = sequence.next(impl)
        with impl.GradientTape() as tape:
            loss = forward_at(value)
        return lambda: tape.gradient(loss, sources)

    return forward, record


def _varlen_rnn(tf):
    """The rnn cell over sequences whose length changes every step."""
    params, run = _rnn_cell(tf, 9, 48)
    return _variable_case(run, _Sequence(_lengths(10, 8, 48)), params)


def _varlen_attention(tf):
    """One self-attention layer (4 heads of 16) over a batch of 8 sequences
    whose length changes every step."""
    rng = np.random.default_rng(11)
    d, heads = 64, 4
    wq, wk, wv, wo = (tf.Variable(rng.normal(0, d ** -0.5, (d, d)).astype("float32"))
                      for _ in range(4))
    xs = tf.constant(rng.normal(size=(8, 128, d)).astype("float32"))

    def split(h, n):
        return tf.transpose(tf.reshape(h, (8, n, heads, d // heads)), (0, 2, 1, 3))

    def forward_at(n):
        x = xs[:, :n]
        q, k, v = (split(tf.matmul(x, w), n) for w in (wq, wk, wv))
        att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / 4.0)
        h = tf.reshape(tf.transpose(tf.matmul(att, v), (0, 2, 1, 3)), (8, n, d))
        return tf.reduce_mean(tf.square(tf.matmul(h, wo) + x))

    return _variable_case(forward_at, _Sequence(_lengths(12, 16, 128)),
                          [wq, wk, wv, wo])


def _last_batch(tf):
    """Training epochs over 1,000 examples in batches of 64: 15 full
    batches, then one of 40."""
    forward, _ = _dense_stack(tf, [64, 64, 64, 10], 1, 13)
    params = forward.params
    rng = np.random.default_rng(13)
    data = rng.normal(size=(1000, 64)).astype("float32")
    labels = rng.integers(0, 10, 1000)
    batches = [(tf.constant(data[i:i + 64]), tf.constant(labels[i:i + 64]))
               for i in range(0, 1000, 64)]

    def forward_at(i):
        return forward(*batches[i])   # the MLP's loss on batch i

    return _variable_case(forward_at, _Sequence(range(len(batches))), params)


def _policy_gradient(tf):
    """REINFORCE-like: per episode ``tf.random.set_seed(episode)`` (which
    drops the kernels of every traced function), then a rollout of a
    variable number of steps sampling actions from a small policy, and
    the gradient of sum(log pi(a_t) * return_t)."""
    rng = np.random.default_rng(14)
    w1 = tf.Variable(rng.normal(0, 0.3, (8, 32)).astype("float32"))
    b1 = tf.Variable(np.zeros(32, "float32"))
    w2 = tf.Variable(rng.normal(0, 0.3, (32, 4)).astype("float32"))
    obs = tf.constant(rng.normal(size=(64, 1, 8)).astype("float32"))
    returns = tf.constant(rng.normal(size=(64,)).astype("float32"))
    episodes = _Sequence(list(enumerate(_lengths(15, 10, 40))))

    def forward_at(episode):
        seed, length = episode
        tf.random.set_seed(seed)
        loss = 0.0
        for t in range(length):
            logits = tf.matmul(tf.nn.relu(tf.matmul(obs[t], w1) + b1), w2)
            action = tf.random.categorical(logits, 1)[:, 0]
            logp = tf.reduce_sum(tf.nn.log_softmax(logits) * tf.one_hot(action, 4))
            loss = loss - logp * returns[t]
        return loss

    return _variable_case(forward_at, episodes, [w1, b1, w2])


WORKLOADS = [
    Workload("chain", _chain, "200-step elementwise chain y = sin(y) * x, 2x2"),
    Workload("mlp_small", _mlp_small, "MLP step: 3 dense layers of 64, batch 32"),
    Workload("mlp_large", _mlp_large, "MLP step: 784-256-256-10, batch 64"),
    Workload("rnn", _rnn, "unrolled tanh RNN cell, 40 steps, batch 8"),
    Workload("cnn", _cnn, "small CNN step: 2 conv + pool, batch 16, 16x16"),
    Workload("embedding", _embedding, "embedding step (IndexedSlices)"),
    Workload("hvp", _hvp, "Hessian-vector product (forward over reverse)"),
    Workload("jvp", _jvp, "JVP through the small MLP (forward mode)"),
    Workload("jacobian", _jacobian, "jacobian of a 32-output function",
             max_repeats=10),
    Workload("matmul", _matmul, "compute-bound: 4 chained 512x512 matmuls"),
    Workload("recording", _recording,
             f"recording cost: {RECORDING_OPS} chained tf.sin, 2x2 "
             f"(rec / {RECORDING_OPS} = per op)", ops_per_step=RECORDING_OPS),
    Workload("recording_dying", _recording_dying,
             f"recording cost: the same {RECORDING_OPS} tf.sin recorded, then "
             f"the tape dropped with no gradient", ops_per_step=RECORDING_OPS),
    Workload("varlen_rnn", _varlen_rnn, "rnn cell over 8-48 steps, 20 lengths "
             "(Zipf-like), a new length each step", variable=True),
    Workload("varlen_attention", _varlen_attention, "self-attention, 4 heads, "
             "batch 8, 20 sequence lengths 16-128", variable=True),
    Workload("last_batch", _last_batch, "MLP epochs of 1,000 examples, batch "
             "64: the 16th batch has 40", variable=True),
    Workload("policy_gradient", _policy_gradient, "REINFORCE rollouts of 10-40 "
             "steps, tf.random.set_seed per episode", variable=True),
]
BY_NAME = {w.name: w for w in WORKLOADS}
