"""Train a small flax **nnx** CNN with BatchNorm and dropout through ``jaxdp.DataParallel``.

The nnx counterpart of ``cnn_linen.py`` (same data, same layers). What is specific to nnx:

* ``graphdef, params, rest = nnx.split(model, nnx.Param, ...)``: ``params`` are trained,
  ``rest`` (the ``BatchStat`` running statistics) is the engine's ``model_state``. It is passed
  as ``nnx.as_pure(rest)`` (plain arrays; the ``nnx.State`` itself works too) and ``loss_fn``
  returns the same form: ``nnx.as_pure(nnx.split(m, nnx.Param, ...)[2])`` after the forward
  pass.
* Dropout takes its key from the engine: ``nnx.Dropout(rate)`` is built without ``rngs`` and
  called as ``dropout(x, rngs=rng)`` with the ``rng=`` the engine passes ``loss_fn`` (a fresh
  key per step, rank and micro-batch). A model whose layers hold their own ``nnx.Rngs``
  streams would put ``RngKey`` / ``RngCount`` variables into ``rest``; the model state is
  averaged over the ranks every step, which a key cannot be, so ``init`` refuses it. Split that
  state off and keep it out of ``model_state``: ``graphdef, params, rngs, rest =
  nnx.split(model, nnx.Param, nnx.RngState, ...)``, and ``nnx.merge(graphdef, params, rngs,
  model_state)`` in ``loss_fn``.
* ``nnx.BatchNorm(..., axis_name=cfg.data_axis)`` normalises over the whole global
  micro-batch (the engine binds the data axis inside its step).

For evaluation, ``nnx.update(model, engine.params(state), engine.model_state(state))`` puts
the trained weights and statistics back into the module, and ``model.eval()`` switches to
running averages and no dropout.

Run:  python examples/cnn_nnx.py [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # 8 simulated CPU devices, before jax starts
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxdp

# Seven-segment digits on an 8x8 grid (as in cnn_linen.py): the segments each digit lights,
# and where each segment is: (rows, cols).
SEGMENTS = ["abcefg", "cf", "acdeg", "acdfg", "bcdf", "abdfg", "abdefg", "acf", "abcdefg", "abcdfg"]
STROKES = {
    "a": (slice(1, 2), slice(2, 6)),  # top
    "b": (slice(1, 4), slice(2, 3)),  # top left
    "c": (slice(1, 4), slice(5, 6)),  # top right
    "d": (slice(3, 4), slice(2, 6)),  # middle
    "e": (slice(4, 7), slice(2, 3)),  # bottom left
    "f": (slice(4, 7), slice(5, 6)),  # bottom right
    "g": (slice(6, 7), slice(2, 6)),  # bottom
}


def digits(n: int, seed: int, noise: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    """``n`` noisy, shifted 8x8 digit images ``[n, 8, 8, 1]`` (float32) and labels ``[n]``."""
    templates = np.zeros((10, 8, 8), np.float32)
    for d, segs in enumerate(SEGMENTS):
        for s in segs:
            templates[d][STROKES[s]] = 1.0
    rs = np.random.RandomState(seed)
    labels = rs.randint(0, 10, n)
    shifts = rs.randint(-1, 2, (n, 2))  # up to one pixel in each direction
    x = np.stack([np.roll(templates[y], tuple(s), axis=(0, 1)) for y, s in zip(labels, shifts)])
    x = x * rs.uniform(0.7, 1.3, (n, 1, 1)) + noise * rs.randn(n, 8, 8)
    return x[..., None].astype(np.float32), labels.astype(np.int32)


class CNN(nnx.Module):
    """(Conv, BatchNorm, relu) x 2, dropout, a linear classifier. ``axis_name``: the axis
    BatchNorm averages its batch statistics over (``None``: each device's own examples)."""

    def __init__(self, *, rngs: nnx.Rngs, axis_name: str | None = None, dropout: float = 0.2):
        self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, momentum=0.9, axis_name=axis_name, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, momentum=0.9, axis_name=axis_name, rngs=rngs)
        self.dropout = nnx.Dropout(dropout)  # no rngs of its own: the key is passed in
        self.out = nnx.Linear(8 * 8 * 32, 10, rngs=rngs)

    def __call__(self, x, *, rng=None):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.bn2(self.conv2(x)))
        x = self.dropout(x.reshape(x.shape[0], -1), rngs=rng)
        return self.out(x)


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=256, help="global batch (default: %(default)s)")
    args = p.parse_args(argv)

    cfg = jaxdp.DDPConfig(zero_stage=1, num_microbatches=2)
    model = CNN(rngs=nnx.Rngs(0), axis_name=cfg.data_axis)  # synchronised BatchNorm
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch, *, model_state, rng):
        m = nnx.merge(graphdef, params, model_state)
        logits = m(batch["x"], rng=rng)  # updates m's BatchStat variables
        _, _, new_state = nnx.split(m, nnx.Param, ...)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return jaxdp.LossOutput(
            loss, aux={"accuracy": accuracy}, model_state=nnx.as_pure(new_state)
        )

    engine = jaxdp.DataParallel(loss_fn, optax.adam(5e-3), cfg)
    state = engine.init(params, model_state=nnx.as_pure(rest), rng=jax.random.key(1))
    x_train, y_train = digits(args.steps * args.batch, seed=1)
    for step in range(args.steps):
        sl = slice(step * args.batch, (step + 1) * args.batch)
        batch = engine.shard_batch({"x": x_train[sl], "y": y_train[sl]})
        state, metrics = engine.step(state, batch)
    train_acc = float(metrics["aux"]["accuracy"])

    # Eval on one device: trained weights and statistics back in the module, eval mode.
    nnx.update(model, engine.params(state), engine.model_state(state))
    model.eval()  # BatchNorm: running averages; Dropout: off
    x_test, y_test = digits(2000, seed=2)
    logits = nnx.jit(lambda m, x: m(x))(model, x_test)
    test_acc = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
    print(
        f"nnx CNN on {engine.dp} devices, {args.steps} steps: loss {float(metrics['loss']):.3f}, "
        f"train accuracy {train_acc:.3f}, test accuracy {test_acc:.3f} (chance 0.100)"
    )
    return test_acc


if __name__ == "__main__":
    main()
