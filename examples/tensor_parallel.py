"""Data parallelism composed with Megatron-style tensor parallelism on a ``data x model`` mesh.

A flax linen MLP whose kernels carry their own partitioning annotations: the up projection is
split by columns (``(None, "model")``), the down projection by rows (``("model", None)``). The
params are placed on the 2-D mesh with those shardings and handed to ``jaxdp.DataParallel``
unchanged: the step is manual over ``data`` only, so the compiler runs the model's tensor
parallelism, and jaxdp buckets, reduces and shards (ZeRO-1) each model rank's own blocks over
``data``. The trained params are checked against plain single-device training.

Run:  python examples/tensor_parallel.py [--steps 20]
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
from jax.sharding import NamedSharding

import jaxdp


class MLP(nn.Module):
    hidden: int = 64

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        up = nn.Dense(self.hidden, kernel_init=nn.with_partitioning(init, (None, "model")))
        down = nn.Dense(x.shape[-1], kernel_init=nn.with_partitioning(init, ("model", None)))
        return down(jnp.tanh(up(x)))


def main(argv=None) -> None:
    args = argparse.ArgumentParser(description=__doc__)
    args.add_argument("--steps", type=int, default=20)
    steps = args.parse_args(argv).steps

    mesh = jax.make_mesh((4, 2), ("data", "model"))  # 8 devices: dp = 4, tp = 2
    model = MLP()
    x0 = jnp.zeros((1, 16))
    boxed = model.init(jax.random.key(0), x0)["params"]
    specs = nn.get_partition_spec(boxed)  # PartitionSpecs from the annotations
    params = nn.unbox(boxed)
    placed = jax.tree.map(lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), params, specs)

    def loss_fn(p, batch):
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    cfg = jaxdp.DDPConfig(zero_stage=1, num_microbatches=2, bucket_size=1024)
    opt = optax.adamw(1e-2)
    engine = jaxdp.DataParallel(loss_fn, opt, cfg, mesh=mesh)
    state = engine.init(placed)

    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((16, 16)) / 4
    batches = []
    for _ in range(steps):
        x = rng.standard_normal((64, 16)).astype(np.float32)
        batches.append({"x": jnp.asarray(x), "y": jnp.asarray(np.sin(x @ teacher), jnp.float32)})

    for batch in batches:
        state, metrics = engine.step(state, engine.shard_batch(batch))

    # Plain single-device training of the same model on the same batches.
    ref, opt_state = params, opt.init(params)
    for batch in batches:
        grads = jax.grad(loss_fn)(ref, batch)
        updates, opt_state = opt.update(grads, opt_state, ref)
        ref = optax.apply_updates(ref, updates)

    kernel = state.params["Dense_0"]["kernel"]
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(engine.params(state)), jax.tree.leaves(ref), strict=True)
    )
    print(f"mesh {dict(mesh.shape)}, ZeRO-1, {len(engine.layout.buckets)} buckets per model rank")
    print(f"up kernel {kernel.shape} stays sharded {kernel.sharding.spec}")
    print(f"final loss {float(metrics['loss']):.4f}")
    print(f"max |param - reference| = {diff:.2e}")
    assert diff < 1e-5, diff


if __name__ == "__main__":
    main()
