"""Gradient collectives: reduce_gradients semantics and FP32-accumulation numerics."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxdp import (
    BucketLayout,
    DDPConfig,
    all_to_all_fp32_reduce_scatter,
    make_mesh,
    reduce_buckets,
    reduce_gradients,
    ring_reduce_scatter,
)
from jaxdp.testing import round_to_bf16

BF16 = ml_dtypes.bfloat16


def per_rank_values(dp: int, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Gradients of mixed magnitudes, as bf16 values on every rank.
    x = rng.standard_normal((dp, n)) * np.exp(rng.uniform(-4, 4, (1, n)))
    return x.astype(np.float32).astype(BF16)


def simulate(fn, x: np.ndarray):
    """Run a per-rank collective over a vmapped axis of size dp (no devices needed)."""
    dp = x.shape[0]
    return np.asarray(jax.vmap(lambda v: fn(v, "d", dp), axis_name="d")(jnp.asarray(x)))


def exact_mean_shards(x: np.ndarray) -> np.ndarray:
    dp, n = x.shape
    return round_to_bf16(x.astype(np.float64).sum(0) / dp).reshape(dp, n // dp)


def test_round_to_bf16_reference():
    # bf16 spacing at 1.0 is 2**-7, so 1 + 2**-8 is a tie.
    vals = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -1.0 - 2**-8 - 2**-30, 3e-3])
    out = round_to_bf16(vals).astype(np.float64)
    assert out[0] == 1.0
    assert out[1] == 1.0  # tie -> even
    assert out[2] == 1.0 + 2**-6  # tie -> even (up)
    assert out[3] == -1.0 - 2**-7  # just past the tie (beyond fp32 precision) -> away
    assert abs(out[4] - 3e-3) <= 3e-3 * 2**-8


def fp32_accum_prescaled(v, axis, dp):
    # Megatron: pre-scale by 1/dp in the gradient dtype, bf16 all_to_all, fp32 sum, one cast.
    return all_to_all_fp32_reduce_scatter(v * jnp.asarray(1.0 / dp, v.dtype), axis, dp)


def fp32_wire(v, axis, dp):
    # grad_reduce_in_fp32: cast before the reduce-scatter, sum on an fp32 wire.
    out = jax.lax.psum_scatter(v.astype(jnp.float32), axis, tiled=True) / dp
    return out.astype(v.dtype)


def bf16_ring(v, axis, dp):
    # What a bf16 NCCL ring does: round to bf16 after every hop.
    return ring_reduce_scatter(v * jnp.asarray(1.0 / dp, v.dtype), axis, dp)


@pytest.mark.parametrize("dp", [2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("fn", [fp32_accum_prescaled, fp32_wire], ids=["all_to_all", "fp32"])
def test_fp32_accumulation_is_correctly_rounded(dp, fn):
    x = per_rank_values(dp, dp * 2048, seed=dp)
    got = simulate(fn, x)
    want = exact_mean_shards(x)
    assert got.dtype == BF16
    mismatches = int(np.sum(got.astype(np.float32) != want.astype(np.float32)))
    assert mismatches == 0


@pytest.mark.parametrize("dp", [4, 8, 16, 64])
def test_bf16_ring_baseline_shows_the_error(dp):
    x = per_rank_values(dp, dp * 2048, seed=dp)
    want = exact_mean_shards(x).astype(np.float64)
    ring = simulate(bf16_ring, x).astype(np.float64)
    fixed = simulate(fp32_accum_prescaled, x).astype(np.float64)
    ring_err = np.abs(ring - want) / np.abs(want).clip(1e-30)
    assert np.mean(ring != want) > 0.05  # many elements are off
    assert ring_err.max() > 2**-8  # by more than one bf16 rounding
    assert np.array_equal(fixed, want)


def test_all_to_all_path_on_devices_matches_simulation():
    mesh = make_mesh()
    dp = mesh.shape["data"]
    x = per_rank_values(dp, dp * 512, seed=7)
    f = jax.shard_map(
        lambda v: fp32_accum_prescaled(v[0], "data", dp)[None],
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )
    got = np.asarray(jax.jit(f)(jnp.asarray(x)))
    np.testing.assert_array_equal(got.astype(np.float32), exact_mean_shards(x).astype(np.float32))


# ------------------------------------------------------------------ reduce_gradients
def grads_per_rank(dp):
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((dp, 5, 3)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((dp, 3)), jnp.float32),
    }


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("avg", [False, True])
@pytest.mark.parametrize("bucket_size", [4, None])
def test_reduce_gradients_is_the_mean(stage, avg, bucket_size):
    mesh = make_mesh()
    dp = mesh.shape["data"]
    per_rank = grads_per_rank(dp)
    cfg = DDPConfig(zero_stage=stage, average_in_collective=avg, bucket_size=bucket_size)
    layout = BucketLayout.from_params(jax.tree.map(lambda x: x[0], per_rank), cfg, dp)
    mean = jax.tree.map(lambda x: np.asarray(x).mean(0), per_rank)
    local = lambda g: reduce_gradients(jax.tree.map(lambda x: x[0], g), layout, cfg)  # noqa: E731
    if stage == 0:
        f = jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P())
        out = jax.jit(f)(per_rank)
    else:
        f = jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        out = layout.from_global_view(jax.jit(f)(per_rank))
    for k in mean:
        np.testing.assert_allclose(out[k], mean[k], rtol=1e-6, atol=1e-7)


def test_reduce_gradients_counts_one_collective_per_bucket():
    mesh = make_mesh()
    dp = mesh.shape["data"]
    per_rank = grads_per_rank(dp)
    for stage, op in ((0, "all_reduce"), (1, "reduce_scatter")):
        cfg = DDPConfig(zero_stage=stage, bucket_size=4)
        layout = BucketLayout.from_params(jax.tree.map(lambda x: x[0], per_rank), cfg, dp)
        f = jax.shard_map(
            lambda g, layout=layout, cfg=cfg: reduce_gradients(
                jax.tree.map(lambda x: x[0], g), layout, cfg
            ),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P() if stage == 0 else P("data"),
        )
        text = jax.jit(f).lower(per_rank).as_text()
        assert text.count(f"stablehlo.{op}") == len(layout.buckets) == 2


def test_reduce_errors():
    cfg = DDPConfig(calculate_per_token_loss=True)
    layout = BucketLayout.from_params({"w": jnp.ones(3)}, cfg, 2)
    with pytest.raises(ValueError, match="global token count"):
        reduce_gradients({"w": jnp.ones(3)}, layout, cfg)
    with pytest.raises(ValueError, match=r"got 2 buckets; the layout has 1"):
        reduce_buckets((jnp.ones(3), jnp.ones(3)), layout, DDPConfig())
