"""Expert parallelism: a top-k mixture-of-experts layer in flax on a ``data x expert`` mesh.

``DDPConfig(expert_axis="expert")`` makes the dense data-parallel group span both axes (the
batch is split over all 8 devices) and the step's ``shard_map`` manual over both. Expert
weights are split over ``expert`` on their first dimension, so each rank holds
``num_experts / |expert|`` experts. The layer dispatches with explicit collectives: it
all-gathers the tokens of its ``expert`` group, runs its local experts on every gathered token
weighted by the router's top-k gates (zero for the tokens it does not receive: exact and
dropless), and ``psum_scatter``s the results back to the tokens' ranks. jaxdp reduces the
expert gradients over ``data`` only (the ranks holding the same experts) and the dense ones over
both axes, with Megatron's scaling, so every gradient is the mean over all tokens.

The same module with ``expert_axis=None`` holds every expert and is the single-device
reference; the trained params are checked against it.

Run:  python examples/moe_expert_parallel.py [--steps 10]
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


class MoE(nn.Module):
    """Top-k routed experts (a GELU MLP each) over tokens ``[n, d]``.

    Attributes:
        num_experts: experts in the whole layer.
        hidden: width of each expert.
        top_k: experts per token.
        expert_axis: mesh axis the experts are split over (inside ``shard_map``), or ``None``
            to hold and run every expert locally.
        expert_shards: size of ``expert_axis`` (the params declare their local shape).
    """

    num_experts: int = 8
    hidden: int = 16
    top_k: int = 2
    expert_axis: str | None = None
    expert_shards: int = 1

    @nn.compact
    def __call__(self, x):
        d, local = x.shape[-1], self.num_experts // self.expert_shards
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        router = self.param("router", nn.initializers.lecun_normal(), (d, self.num_experts))
        w_in = self.param("w_in", init, (local, d, self.hidden))
        w_out = self.param("w_out", init, (local, self.hidden, d))
        ax = self.expert_axis
        tokens = x if ax is None else jax.lax.all_gather(x, ax, tiled=True)
        top, idx = jax.lax.top_k(tokens @ router, self.top_k)
        gates = jax.nn.softmax(top, axis=-1)  # [n, k], renormalised over the chosen experts
        dense = jnp.einsum("nk,nke->ne", gates, jax.nn.one_hot(idx, self.num_experts))
        first = 0 if ax is None else jax.lax.axis_index(ax) * local
        mine = jax.lax.dynamic_slice_in_dim(dense, first, local, axis=1)  # [n, local]
        h = jax.nn.gelu(jnp.einsum("nd,edh->enh", tokens, w_in))
        y = jnp.einsum("ne,enh,ehd->nd", mine, h, w_out)
        return y if ax is None else jax.lax.psum_scatter(y, ax, scatter_dimension=0, tiled=True)


class Block(nn.Module):
    """Embedding projection, a residual MoE layer and a head, over ``[batch, seq, d]``."""

    moe: MoE

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = nn.Dense(d, name="embed")(x).reshape(b * t, d)
        h = h + self.moe(h)
        return nn.Dense(d, name="head")(h).reshape(b, t, d)


def models(data: int = 2, experts: int = 4, num_experts: int = 8):
    """The expert-parallel model and its single-device reference (same params)."""
    ep = Block(MoE(num_experts, expert_axis="expert", expert_shards=experts))
    ref = Block(MoE(num_experts))
    return ep, ref


def mse(model):
    def loss_fn(params, batch):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return loss_fn


def main(argv=None) -> None:
    args = argparse.ArgumentParser(description=__doc__)
    args.add_argument("--steps", type=int, default=10)
    steps = args.parse_args(argv).steps

    mesh = jax.make_mesh((2, 4), ("data", "expert"))  # dense dp = 8, expert dp = 2
    ep, ref = models()
    rng = np.random.default_rng(0)
    x0 = jnp.zeros((1, 4, 8))
    params = ref.init(jax.random.key(0), x0)["params"]  # whole: every expert

    cfg = jaxdp.DDPConfig(
        zero_stage=0,
        expert_axis="expert",
        expert_param_patterns=("moe/w_in", "moe/w_out"),  # split over 'expert' on dim 0
    )
    opt = optax.adam(3e-3)
    engine = jaxdp.DataParallel(mse(ep), opt, cfg, mesh=mesh)
    state = engine.init(params)

    teacher = rng.standard_normal((8, 8)) / 3
    batches = []
    for _ in range(steps):
        x = rng.standard_normal((16, 4, 8)).astype(np.float32)
        batches.append({"x": jnp.asarray(x), "y": jnp.asarray(np.tanh(x @ teacher), jnp.float32)})
    for batch in batches:
        state, metrics = engine.step(state, engine.shard_batch(batch))

    ref_params, opt_state = params, opt.init(params)
    for batch in batches:
        grads = jax.grad(mse(ref))(ref_params, batch)
        updates, opt_state = opt.update(grads, opt_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)

    buffers = [(b.shard_axes or "dense", b.numel) for b in engine.layout.buffers]
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(engine.params(state)), jax.tree.leaves(ref_params))
    )
    w_in = state.params["moe"]["w_in"]
    print(f"mesh {dict(mesh.shape)}; buffers (axes, elements per rank): {buffers}")
    print(f"expert weights {w_in.shape} split {w_in.sharding.spec}")
    print(f"final loss {float(metrics['loss']):.4f}")
    print(f"max |param - reference| = {diff:.2e}")
    assert diff < 1e-5, diff


if __name__ == "__main__":
    main()
