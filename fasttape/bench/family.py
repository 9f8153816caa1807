"""A generated family of models for the memory budget's test and bench.

A member is described by a plain dict (``spec``), drawn by ``draw(pick)``
from NumPy (the bench's fixed members) or hypothesis (the test's), from the
same choices:

  dtype     float32, float64 or float16 (float16: no convolution, no
            pooling, no recurrence: CPU kernels for them are slow or absent)
  batch     examples per step
  image     None, or (height, width, channels) of an image input; then
            ``stem``: a list of "conv", "pool" and "norm" blocks run on it
            (3x3 convolution + bias + relu; 2x2 max or average pooling;
            batch normalization from moments), then average pooling down to
            MAX_ATTENDED pixels if an attention block follows
  tokens    (the sequence input, when there is no image) (length, width)
  blocks    a list of "dense", "attention", "recurrent" and "norm" blocks
            run on the sequence (the image's pixels become its tokens):
            dense: matmul + bias + an activation; attention: one head of
            self-attention with a residual; recurrent: an LSTM cell unrolled
            over the first few tokens (its outputs become the sequence);
            norm: layer normalization
  width     the width of the dense and attention blocks (and the channels
            of the convolutions)
  seed      the weights' and input's seed

``build(tf, spec)`` -> (params, loss): ``loss()`` runs the forward pass and
returns a scalar, with raw TF ops (no Keras): the family's members differ
in structure, not in the framework's bookkeeping.
"""

import numpy as np

DTYPES = ("float32", "float64", "float16")
STEM = ("conv", "pool", "norm")
BLOCKS = ("dense", "attention", "recurrent", "norm")
ACTIVATIONS = ("relu", "tanh", "sigmoid", "gelu", "elu")
RECURRENT_STEPS = 6
MAX_ATTENDED = 64     # tokens, at most, into an attention block (pooled to it)


def draw(pick, scale=1):
    """One member's spec. ``pick(options)`` returns one of a tuple of
    options (repeated options weigh more): a NumPy generator's (``numpy_pick``)
    or hypothesis' (the test's). scale multiplies the batch (the bench's
    members are larger than the test's)."""
    dtype = pick(DTYPES[:1] * 3 + DTYPES[1:2] * 2 + DTYPES[2:])
    spec = {"dtype": dtype, "batch": pick(tuple(range(2, 9))) * scale,
            "width": pick((16, 32, 48, 64)), "seed": pick(tuple(range(1000))),
            "image": None, "stem": [], "tokens": None, "blocks": [],
            "activation": pick(ACTIVATIONS)}
    if dtype != "float16" and pick((True, True, True, False, False)):
        side = pick((8, 12, 16, 24))
        spec["image"] = (side, side, pick((1, 2, 3, 4)))
        spec["stem"] = [pick(STEM[:1] * 3 + STEM[1:]) for _ in range(pick((1, 2, 3, 4, 5)))]
    else:
        spec["tokens"] = (pick((4, 8, 12, 16, 24, 32)), pick((8, 16, 32)))
    blocks = BLOCKS if dtype != "float16" else BLOCKS[:2] + BLOCKS[3:]
    spec["blocks"] = [pick(blocks) for _ in range(pick((1, 2, 3, 4, 5, 6)))]
    return spec


def numpy_pick(rng):
    """draw's ``pick`` from a NumPy Generator."""
    return lambda options: options[int(rng.integers(len(options)))]


def describe(spec):
    """A short name for a member (the bench's rows, a test's id)."""
    head = ("img{}x{}x{}".format(*spec["image"]) if spec["image"]
            else "seq{}x{}".format(*spec["tokens"]))
    body = "-".join(spec["stem"] + spec["blocks"])
    return f"{spec['dtype'][5:]}b{spec['batch']}w{spec['width']}{head}-{body}"


def build(tf, spec):
    """(params, loss) for a member: variables and a forward pass."""
    rng = np.random.default_rng(spec["seed"])
    dtype = spec["dtype"]
    width = spec["width"]
    act = {"relu": tf.nn.relu, "tanh": tf.tanh, "sigmoid": tf.sigmoid,
           "gelu": tf.nn.gelu, "elu": tf.nn.elu}[spec["activation"]]
    params = []

    def var(shape, fan_in=None, value=None):
        if value is None:
            value = rng.normal(0, 1 / np.sqrt(fan_in), shape)
        v = tf.Variable(np.asarray(value, dtype))
        params.append(v)
        return v

    batch = spec["batch"]
    stages = []     # functions from the running tensor to the next
    if spec["image"]:
        h, w, c = spec["image"]
        x = tf.constant(rng.normal(size=(batch, h, w, c)).astype(dtype))
        for kind in spec["stem"]:
            if kind == "conv":
                k, b = var((3, 3, c, width), 9 * c), var((width,), value=np.zeros(width))
                stages.append(lambda y, k=k, b=b: tf.nn.relu(
                    tf.nn.bias_add(tf.nn.conv2d(y, k, 1, "SAME"), b)))
                c = width
            elif kind == "pool":
                if h >= 4 and w >= 4:
                    pool = tf.nn.max_pool2d if rng.random() < 0.5 else tf.nn.avg_pool2d
                    stages.append(lambda y, pool=pool: pool(y, 2, 2, "VALID"))
                    h, w = h // 2, w // 2
            else:
                g, b = var((c,), value=np.ones(c)), var((c,), value=np.zeros(c))
                stages.append(lambda y, g=g, b=b: _batch_norm(tf, y, g, b))
        while h * w > MAX_ATTENDED and "attention" in spec["blocks"]:
            # (Attention's cost grows with the square of the tokens.)
            stages.append(lambda y: tf.nn.avg_pool2d(y, 2, 2, "VALID"))
            h, w = h // 2, w // 2
        tokens, features = h * w, c
        stages.append(lambda y, n=tokens, f=features: tf.reshape(y, (batch, n, f)))
    else:
        tokens, features = spec["tokens"]
        x = tf.constant(rng.normal(size=(batch, tokens, features)).astype(dtype))
    for kind in spec["blocks"]:
        if kind == "dense":
            m, b = var((features, width), features), var((width,), value=np.zeros(width))
            stages.append(lambda y, m=m, b=b: act(tf.tensordot(y, m, 1) + b))
            features = width
        elif kind == "attention":
            q, k, v = (var((features, features), features) for _ in range(3))
            stages.append(lambda y, q=q, k=k, v=v: _attention(tf, y, q, k, v))
        elif kind == "recurrent":
            steps = min(tokens, RECURRENT_STEPS)
            m = var((features + width, 4 * width), features + width)
            b = var((4 * width,), value=np.zeros(4 * width))
            stages.append(lambda y, m=m, b=b, steps=steps: _lstm(tf, y, m, b, steps, width))
            tokens, features = steps, width
        else:
            g, b = var((features,), value=np.ones(features)), var((features,), value=np.zeros(features))
            stages.append(lambda y, g=g, b=b: _layer_norm(tf, y, g, b))
    head = var((features, 1), features)

    def loss():
        y = x
        for stage in stages:
            y = stage(y)
        out = tf.tensordot(y, head, 1)
        return tf.reduce_mean(tf.square(out))

    return params, loss


def _batch_norm(tf, y, g, b):
    mean, var = tf.nn.moments(y, [0, 1, 2])
    return tf.nn.batch_normalization(y, mean, var, b, g, 1e-3)


def _layer_norm(tf, y, g, b):
    mean, var = tf.nn.moments(y, [-1], keepdims=True)
    return (y - mean) * tf.math.rsqrt(var + 1e-3) * g + b


def _attention(tf, y, q, k, v):
    scale = 1 / np.sqrt(int(q.shape[0]))
    a = tf.nn.softmax(tf.matmul(tf.tensordot(y, q, 1), tf.tensordot(y, k, 1),
                                transpose_b=True) * scale)
    return y + tf.matmul(a, tf.tensordot(y, v, 1))


def _lstm(tf, y, m, b, steps, width):
    batch = y.shape[0]
    h = tf.zeros((batch, width), y.dtype)
    c = tf.zeros((batch, width), y.dtype)
    outs = []
    for t in range(steps):
        z = tf.matmul(tf.concat([y[:, t], h], 1), m) + b
        i, f, g, o = tf.split(z, 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        h = tf.sigmoid(o) * tf.tanh(c)
        outs.append(h)
    return tf.stack(outs, 1)


def family(seed, n, scale=1):
    """n members drawn from a fixed seed."""
    pick = numpy_pick(np.random.default_rng(seed))
    return [draw(pick, scale) for _ in range(n)]
