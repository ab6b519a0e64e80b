"""A hand-written ``jax.shard_map`` training loop that uses ``jaxdp.reduce_gradients``.

For users who keep their own step function: each device computes the gradient of its slice of
the batch with respect to a *varying* copy of the replicated params (so autodiff inserts no
collective), ``reduce_gradients`` averages them bucket by bucket, and optax updates the
replicated params (ZeRO stage 0). The result is checked against plain single-device training.

Run:  python examples/shard_map_reduce_gradients.py
"""

from __future__ import annotations

import os

if "jax" not in __import__("sys").modules:  # 8 simulated CPU devices, before jax starts
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdp


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def main(steps: int = 20) -> None:
    mesh = jaxdp.make_mesh()
    cfg = jaxdp.DDPConfig(zero_stage=0)
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((8, 32)) / 3, jnp.float32),
        "b1": jnp.zeros((32,), jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((32, 2)) / 6, jnp.float32),
    }
    layout = jaxdp.BucketLayout.from_params(params, cfg, jaxdp.dp_size(mesh))
    opt = optax.adam(1e-2)

    def local_grads(p, batch):
        pv = jax.tree.map(lambda w: jax.lax.pcast(w, "data", to="varying"), p)
        grads = jax.grad(loss_fn)(pv, batch)  # this device's slice only
        return jaxdp.reduce_gradients(grads, layout, cfg)  # one collective per bucket

    grads_fn = jax.shard_map(local_grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())

    @jax.jit
    def step(p, s, batch):
        g = grads_fn(p, batch)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    ref_p, ref_s = params, opt.init(params)
    p, s = params, opt.init(params)
    sharding = NamedSharding(mesh, P("data"))
    for i in range(steps):
        r = np.random.default_rng(i)
        batch = {
            "x": jnp.asarray(r.standard_normal((64, 8)), jnp.float32),
            "y": jnp.asarray(r.standard_normal((64, 2)), jnp.float32),
        }
        p, s = step(p, s, jax.device_put(batch, sharding))
        g = jax.grad(loss_fn)(ref_p, batch)  # the plain single-device reference
        u, ref_s = opt.update(g, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    err = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p))
    )
    print(f"{steps} steps on {mesh.shape['data']} devices; max |param - reference| = {err:.2e}")
    if err > 1e-5:
        raise SystemExit("the shard_map loop does not match the reference")


if __name__ == "__main__":
    main()
