"""The alpha-beta link model: ring collective times against hand-computed numbers, the bucket
size rule across nodes, and the engine that applies it on a mesh spanning two hosts."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxdp import DataParallel, DDPConfig, default_bucket_size
from jaxdp._src.topology.links import (
    INFINIBAND,
    NVLINK,
    BucketChoice,
    Link,
    all_gather_time,
    all_reduce_time,
    auto_bucket_bytes,
    collective_time,
    nodes_of,
    reduce_scatter_time,
    ring_link,
)


def test_ring_formulas_by_hand():
    link = Link(2e-6, 100e9)
    # 8 ranks, 1 GB: 7 steps of 2 us, and 7/8 of the bytes at 100 GB/s
    assert reduce_scatter_time(1e9, 8, link) == pytest.approx(14e-6 + 8.75e-3)
    assert all_gather_time(1e9, 8, link) == reduce_scatter_time(1e9, 8, link)
    assert all_reduce_time(1e9, 8, link) == pytest.approx(2 * (14e-6 + 8.75e-3))
    assert collective_time("all-reduce", 1e9, 8, link) == pytest.approx((28e-6, 17.5e-3))
    assert reduce_scatter_time(1e9, 1, link) == 0.0  # one rank moves nothing
    # the defaults: 8 GPUs of a node, 0.61 GB of bf16 gradients (the 304M GPT)
    assert reduce_scatter_time(0.61e9, 8, NVLINK) == pytest.approx(
        7 * 3.4e-6 + 7 / 8 * 0.61e9 / 450e9
    )
    with pytest.raises(ValueError, match="kind='all-to-all'"):
        collective_time("all-to-all", 1.0, 8, link)


def test_a_ring_across_nodes():
    two = ring_link(2, 8)
    # 15 steps: 14 over NVLink, 1 over the network; every byte at the network's rate
    assert two.alpha_s * 15 == pytest.approx(14 * 3.4e-6 + 9.6e-6)
    assert two.beta_bytes_per_s == INFINIBAND.beta_bytes_per_s
    assert ring_link(1, 8) is NVLINK
    # 304M GPT, fp32 wire (1.22 GB), flat over 2 nodes: 15/16 of it at 50 GB/s = 22.9 ms
    assert reduce_scatter_time(1.22e9, 16, two) == pytest.approx(22.875e-3 + 57.2e-6)


def test_link_errors():
    with pytest.raises(ValueError, match=r"Link\.beta_bytes_per_s: got 0"):
        Link(1e-6, 0)
    with pytest.raises(ValueError, match=r"Link\.alpha_s: got -1"):
        Link(-1, 1e9)
    with pytest.raises(ValueError, match="ranks=0"):
        reduce_scatter_time(1.0, 0, NVLINK)


def test_the_rule_for_the_304m_gpt_on_two_nodes():
    """0.61 GB of bf16 gradients reduce-scattered over 2 x 8 GPUs: L = 57.2 us per bucket,
    b = 53.3 GB/s of bucket bytes; sqrt(S L b) = 43.1 MB, over the 30.5 MB floor where the
    latency is a tenth of the transfer, under the 80 MB of Megatron's 40M-element default."""
    link = ring_link(2, 8)
    latency = 15 * link.alpha_s
    rate = 50e9 * 16 / 15
    got = auto_bucket_bytes(0.61e9, 16, link, largest_bytes=80e6)
    assert got == int(math.sqrt(0.61e9 * latency * rate))
    assert 30.5e6 < got < 80e6 and round(got / 1e6, 1) == 43.1
    # Priced: 15 buckets, and less exposed than the default's 8 buckets of 80 MB
    auto = BucketChoice.price("auto", link, "reduce-scatter", 16, [got] * 14 + [0.61e9 - 14 * got])
    megatron = BucketChoice.price("auto", link, "reduce-scatter", 16, [80e6] * 7 + [50e6])
    assert auto.exposed_s < megatron.exposed_s
    assert auto.transfer_s == pytest.approx(megatron.transfer_s)


def test_the_rule_at_its_bounds():
    # 7B in bf16 (14 GB) on 2 nodes: the optimum (207 MB) is over the default: the default
    assert auto_bucket_bytes(14e9, 16, ring_link(2, 8), largest_bytes=80e6) == 80_000_000
    # a small model: the floor (latency a tenth of the transfer), here more than it holds
    link = ring_link(16, 8)
    floor = 2 * 127 * link.alpha_s * (50e9 * 128 / 127 / 2) / 0.1
    got = auto_bucket_bytes(1e6, 128, link, kind="all-reduce", largest_bytes=1e12)
    assert got == int(floor)
    # one node: NVLink's latency-bandwidth product puts the floor (7 x 3.4 us at 514 GB/s of
    # bucket bytes, over 0.1: 122 MB) over Megatron's default, which stays
    assert auto_bucket_bytes(0.61e9, 8, NVLINK, largest_bytes=80e6) == 80_000_000


def test_describe():
    c = BucketChoice.price("auto", NVLINK, "reduce-scatter", 8, [80e6] * 3 + [20e6])
    assert c.describe().startswith("buckets: 4 x 20-80 MB (auto; NVLink model: ")
    assert c.exposed_s == pytest.approx(c.latency_s + 7 / 8 * 20e6 / 450e9)


def test_engine_across_two_hosts(h100):
    """On 2 hosts x 4 compile-only GPUs bucket_size="auto" follows the alpha-beta rule: the
    plan reports it, the layout uses it, and the combine thresholds follow the layout."""
    from jaxdp.aot import abstract_state, example_mlp, h100_mesh

    mesh = h100_mesh(4, hosts=2)
    assert nodes_of(list(mesh.devices.flat)) == 2
    loss_fn, params, batch = example_mlp(16, 1024, batch=64)
    cfg = DDPConfig(zero_stage=1, param_dtype="bfloat16")
    dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=mesh, compiler_options="jaxdp")
    abstract_state(dp, params, batch)
    numel = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    link = ring_link(2, 4)
    want = auto_bucket_bytes(
        sum(b.numel for b in dp.layout.buffers) * 2,
        8,
        link,
        largest_bytes=default_bucket_size(8) * 2,
    )
    assert dp.layout.bucket_size == want // 2 < default_bucket_size(8)
    assert dp.plan.buckets.rule == "auto, alpha-beta rule"
    assert sum(dp.plan.buckets.bucket_bytes) >= numel * jnp.dtype(jnp.bfloat16).itemsize
    rs = dp.compiler_options["xla_gpu_reduce_scatter_combine_threshold_bytes"]
    assert rs == dp.layout.bucket_size // 8 * 2 - 1
    # one host: Megatron's default, priced on NVLink
    one = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=h100_mesh(8))
    abstract_state(one, params, batch)
    assert one.layout.bucket_size == default_bucket_size(8)
    assert one.plan.buckets.rule == "auto" and one.plan.buckets.link is NVLINK
