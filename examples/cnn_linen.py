"""Train a small flax **linen** CNN with BatchNorm and dropout through ``jaxdp.DataParallel``.

The model (Conv, BatchNorm, relu, Conv, BatchNorm, relu, Dropout, Dense) has non-trainable
state (BatchNorm's running statistics, the ``batch_stats`` collection) and needs randomness
(dropout), so it uses the full loss contract:

* ``engine.init(params, model_state={"batch_stats": ...}, rng=jax.random.key(seed))``;
* ``loss_fn(params, batch, *, model_state, rng)`` runs ``model.apply`` with
  ``mutable=list(model_state)`` and ``rngs={"dropout": rng}``, and returns
  ``jaxdp.LossOutput(loss, aux={"accuracy": ...}, model_state=new_state)``;
* ``nn.BatchNorm(axis_name=cfg.data_axis)`` normalises over the whole global micro-batch (the
  engine binds the data axis inside its step), and the ranks' running statistics are averaged
  after every step (``DDPConfig.model_state_sync="mean"``).

Evaluation runs outside the engine, on one device, with ``engine.params(state)`` and
``engine.model_state(state)``: running averages, no dropout, on held-out images.

The data are embedded (no download): 8x8 seven-segment digits 0-9, shifted by up to one pixel,
with random contrast and Gaussian noise, generated from a fixed seed.

Run:  python examples/cnn_linen.py [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # 8 simulated CPU devices, before jax starts
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdp

# Seven-segment digits on an 8x8 grid: the segments each digit lights, and where each segment
# is: (rows, cols).
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


class CNN(nn.Module):
    """(Conv, BatchNorm, relu) x 2, dropout, a linear classifier. ``axis_name``: the axis
    BatchNorm averages its batch statistics over (``None``: each device's own examples)."""

    axis_name: str | None = None
    dropout: float = 0.2

    @nn.compact
    def __call__(self, x, *, train: bool):
        for width in (16, 32):
            x = nn.Conv(width, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(
                x
            )
            x = nn.relu(x)
        x = x.reshape(x.shape[0], -1)
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(10)(x)


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=256, help="global batch (default: %(default)s)")
    args = p.parse_args(argv)

    cfg = jaxdp.DDPConfig(zero_stage=1, num_microbatches=2)
    model = CNN(axis_name=cfg.data_axis)  # synchronised BatchNorm over the data axis
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)), train=False)

    def loss_fn(params, batch, *, model_state, rng):
        logits, new_state = model.apply(
            {"params": params, **model_state},
            batch["x"],
            train=True,
            mutable=list(model_state),  # returns the updated batch_stats
            rngs={"dropout": rng},  # the engine's key: one per step, rank and micro-batch
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return jaxdp.LossOutput(loss, aux={"accuracy": accuracy}, model_state=new_state)

    engine = jaxdp.DataParallel(loss_fn, optax.adam(5e-3), cfg)
    state = engine.init(
        variables["params"],
        model_state={"batch_stats": variables["batch_stats"]},
        rng=jax.random.key(1),
    )
    x_train, y_train = digits(args.steps * args.batch, seed=1)
    for step in range(args.steps):
        sl = slice(step * args.batch, (step + 1) * args.batch)
        batch = engine.shard_batch({"x": x_train[sl], "y": y_train[sl]})
        state, metrics = engine.step(state, batch)
    train_acc = float(metrics["aux"]["accuracy"])

    # Eval on one device: the whole params and model state, running averages, no dropout.
    x_test, y_test = digits(2000, seed=2)
    variables = {"params": engine.params(state), **engine.model_state(state)}
    logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, x_test)
    test_acc = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
    print(
        f"linen CNN on {engine.dp} devices, {args.steps} steps: loss {float(metrics['loss']):.3f}, "
        f"train accuracy {train_acc:.3f}, test accuracy {test_acc:.3f} (chance 0.100)"
    )
    return test_acc


if __name__ == "__main__":
    main()
