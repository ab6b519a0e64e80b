"""Train a flax **nnx** model with ``jaxdp.DataParallel`` (``nnx.split`` / ``nnx.merge``).

``DataParallel`` works on a params pytree. ``nnx.split(model, nnx.Param, ...)`` gives exactly
that (an ``nnx.State`` of the parameters) plus a static graph definition; the loss function
merges them back into a module for the forward pass. After training, ``engine.params(state)``
is the trained ``nnx.State``, and ``nnx.update(model, ...)`` puts it back into the module.

Run:  python examples/train_nnx.py [--steps 100]
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
import optax
from flax import nnx

import jaxdp


class MLP(nnx.Module):
    def __init__(self, din: int, width: int, dout: int, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(din, width, rngs=rngs)
        self.l2 = nnx.Linear(width, width, rngs=rngs)
        self.out = nnx.Linear(width, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.gelu(self.l2(nnx.gelu(self.l1(x)))))


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args(argv)

    model = MLP(4, 64, 1, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        m = nnx.merge(graphdef, params, rest)
        return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

    engine = jaxdp.DataParallel(loss_fn, optax.adam(3e-3), jaxdp.DDPConfig(zero_stage=1))
    state = engine.init(params)
    key = jax.random.key(1)
    first = last = None
    for step in range(args.steps):
        x = jax.random.normal(jax.random.fold_in(key, step), (128, 4))
        y = jnp.sin(x.sum(axis=1, keepdims=True))  # a smooth target to fit
        state, metrics = engine.step(state, engine.shard_batch({"x": x, "y": y}))
        last = float(metrics["loss"])
        first = last if first is None else first
    nnx.update(model, engine.params(state))  # the trained weights back in the module
    print(f"nnx MLP on {engine.dp} devices: loss {first:.4f} -> {last:.4f}")
    if not last < first / 2:
        raise SystemExit("training did not reduce the loss")
    return last


if __name__ == "__main__":
    main()
