"""The compiled step: one collective per bucket (per parameter at stages 1-2, for XLA's
combiners), independent of micro-batches and depth."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import counting_compiles, make_batch, mlp_params, mse_loss

from jaxdp import DataParallel, DDPConfig, make_mesh

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "collective_permute")


def lowered_counts(dp, state, batch):
    text = dp.step.lower(state, dp.shard_batch(batch)).as_text()
    return {op: len(re.findall(rf"stablehlo\.{op}\b", text)) for op in OPS}


def compiled_counts(dp, state, batch):
    text = dp.step.lower(state, dp.shard_batch(batch)).compile().as_text()
    return {op: len(re.findall(rf" {op.replace('_', '-')}(-start)?\(", text)) for op in OPS}


def wire_dtypes(text, op):
    """Element types of the operands of every ``op`` in a lowered StableHLO module."""
    return re.findall(rf'"stablehlo\.{op}"\(.*?[)>] : \(tensor<(?:\d+x)*(\w+)>', text, flags=re.S)


def scanned_params(depth, width=16, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "inp": jnp.asarray(rng.standard_normal((6, width)) * 0.3, jnp.float32),
        "layers": {
            "w": jnp.asarray(rng.standard_normal((depth, width, width)) * 0.2, jnp.float32),
            "b": jnp.zeros((depth, width), jnp.float32),
        },
        "out": jnp.asarray(rng.standard_normal((width, 4)) * 0.3, jnp.float32),
    }


def scanned_loss(params, batch):
    h = batch["x"] @ params["inp"]

    def layer(h, p):
        return jnp.tanh(h @ p["w"] + p["b"]), None

    h, _ = jax.lax.scan(layer, h, params["layers"])
    return jnp.mean((h @ params["out"] - batch["y"]) ** 2)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("depth", [2, 6])
def test_one_collective_per_bucket(stage, g, depth):
    params = scanned_params(depth)
    cfg = DDPConfig(zero_stage=stage, num_microbatches=g, bucket_size=150, clip_grad=1.0)
    dp = DataParallel(scanned_loss, optax.adamw(1e-3), cfg)
    state = dp.init(params)
    batch = make_batch(64)
    n = len(dp.layout.buckets)
    assert n >= 2
    counts = lowered_counts(dp, state, batch)
    if stage == 0:
        # one all-reduce per parameter (XLA's combiner groups them into buckets:
        # jaxdp._src.comm.per_param.AllReduceOps) + the loss mean; the norm of replicated grads is
        # local
        assert dp.plan.strategy.reduces_per_parameter
        assert counts == dict.fromkeys(OPS, 0) | {"all_reduce": len(dp.layout.slots) + 1}
    else:
        # Stages 1-2 reduce-scatter and gather each parameter on its own (XLA's combiners
        # group them into buckets on GPUs: jaxdp._src.comm.per_param): a count fixed by the leaves,
        # not the depth. Stage 2 with G > 1 reduce-scatters every micro-batch, all of them in
        # the scan body (none peeled out: Kernel.peel_last), so once in the program text.
        # The gathers after the update are the partitioner's on this 1-D mesh
        # (ShardedOpt._gather_global): none in the lowered program, one per parameter in the
        # compiled one.
        strategy = dp.plan.strategy
        assert strategy.gathers_per_parameter and strategy.gathers_globally
        n = len(dp.layout.slots)
        assert counts == dict.fromkeys(OPS, 0) | {
            "reduce_scatter": n,
            "all_reduce": 2,  # loss mean and the squared-norm sum
        }
        # XLA's SPMD partitioner adds nothing for the sharded optimizer update.
        compiled = compiled_counts(dp, state, batch)
        assert compiled["reduce_scatter"] == n and compiled["all_gather"] == n


def test_megatron_fp32_accumulation_uses_all_to_all():
    cfg = DDPConfig(
        zero_stage=1,
        reduce_scatter_with_fp32_accumulation=True,
        bucket_size=150,
        param_dtype="bfloat16",
    )
    dp = DataParallel(mse_loss, optax.adam(1e-3), cfg)
    state = dp.init(mlp_params())
    counts = lowered_counts(dp, state, make_batch(64))
    n = len(dp.layout.buckets)
    assert counts["all_to_all"] == n and counts["reduce_scatter"] == 0
    text = dp.step.lower(state, dp.shard_batch(make_batch(64))).as_text()
    # bf16 on the wire, as configured
    wire = wire_dtypes(text, "all_to_all")
    assert len(wire) == n and set(wire) == {"bf16"}, wire


@pytest.mark.parametrize(
    ("kwargs", "dtype"),
    [({}, "bf16"), ({"grad_reduce_in_fp32": True}, "f32")],
)
def test_wire_dtype_of_reduce_scatter(kwargs, dtype):
    cfg = DDPConfig(zero_stage=1, param_dtype="bfloat16", bucket_size=150, **kwargs)
    dp = DataParallel(mse_loss, optax.adam(1e-3), cfg)
    state = dp.init(mlp_params())
    text = dp.step.lower(state, dp.shard_batch(make_batch(64))).as_text()
    wire = wire_dtypes(text, "reduce_scatter")
    assert len(wire) == len(dp.layout.slots) and set(wire) == {dtype}, wire  # per parameter


def test_state_is_donated_and_step_jitted():
    dp = DataParallel(mse_loss, optax.sgd(0.1), DDPConfig(zero_stage=1))
    state = dp.init(mlp_params())
    batch = dp.shard_batch(make_batch(16))
    new, _ = dp.step(state, batch)
    assert jax.tree.leaves(state.master)[0].is_deleted()
    assert not jax.tree.leaves(new.master)[0].is_deleted()
    keep = DataParallel(mse_loss, optax.sgd(0.1), DDPConfig(zero_stage=1), donate=False)
    s2 = keep.init(mlp_params())
    keep.step(s2, batch)
    assert not jax.tree.leaves(s2.master)[0].is_deleted()


def test_lower_from_abstract_state_is_the_real_program():
    params = mlp_params()
    dp = DataParallel(mse_loss, optax.adam(1e-3), DDPConfig(zero_stage=1))
    abstract = jax.eval_shape(dp.init, params)
    batch = jax.eval_shape(lambda: make_batch(64))
    mem_abstract = dp.step.lower(abstract, batch).compile().memory_analysis()
    state = dp.init(params)
    mem_real = dp.step.lower(state, dp.shard_batch(make_batch(64))).compile().memory_analysis()
    # Same donation (aliasing) and the same buffers as the program step() runs.
    assert mem_abstract.alias_size_in_bytes == mem_real.alias_size_in_bytes > 0
    assert mem_abstract.argument_size_in_bytes == mem_real.argument_size_in_bytes


@pytest.mark.parametrize(("dtype", "short"), [("float32", "f32"), ("bfloat16", "bf16")])
def test_accumulator_dtype_survives_the_scan(dtype, short):
    cfg = DDPConfig(num_microbatches=4, main_grads_dtype=dtype, bucket_size=200)
    dp = DataParallel(mse_loss, optax.adam(1e-3), cfg)
    state = dp.init(mlp_params())
    text = dp.step.lower(state, dp.shard_batch(make_batch(64))).as_text()
    header = next(line for line in text.splitlines() if "stablehlo.while" in line)
    carried = set(re.findall(r"tensor<([\dx]+)x(\w+)>", header))
    for leaf in jax.tree.leaves(mlp_params()):
        # One accumulator per parameter, of its shape, carried through the scan in
        # main_grads_dtype (jaxdp._src.strategy.kernels.PerParameter).
        dims = "x".join(map(str, leaf.shape))
        assert (dims, short) in carried, (dims, carried)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_deterministic_reduction_has_no_order_dependent_collective(stage):
    """deterministic_reduction: every bucket is one all_to_all (plus one all_gather at stage 0)
    and every metric an all_gather; no all-reduce or reduce-scatter, whose summation order
    belongs to the collective library, is left."""
    params = scanned_params(2)
    cfg = DDPConfig(
        zero_stage=stage,
        num_microbatches=2,
        bucket_size=150,
        clip_grad=1.0,
        deterministic_reduction=True,
    )
    dp = DataParallel(scanned_loss, optax.adamw(1e-3), cfg)
    state = dp.init(params)
    n = len(dp.layout.buckets)
    counts = lowered_counts(dp, state, make_batch(64))
    # all_to_all: one per bucket, stage 2's too (every micro-batch in the scan body, none
    # peeled out)
    metrics = 1 if stage == 0 else 2  # loss (+ the squared-norm sum of the shards)
    gathers = n + metrics  # stage 0: rebuild each bucket; stages >= 1: the params
    assert counts == dict.fromkeys(OPS, 0) | {"all_to_all": n, "all_gather": gathers}


def test_deterministic_reduction_matches_the_default_numerically():
    params = scanned_params(2)
    batch = make_batch(64)
    out = []
    for det in (False, True):
        cfg = DDPConfig(
            zero_stage=1, num_microbatches=2, bucket_size=150, deterministic_reduction=det
        )
        dp = DataParallel(scanned_loss, optax.adamw(1e-2), cfg)
        state = dp.init(params)
        for _ in range(3):
            state, metrics = dp.step(state, dp.shard_batch(batch))
        out.append((dp.params(state), float(metrics["loss"])))
    for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert abs(out[0][1] - out[1][1]) <= 1e-6 * abs(out[0][1])


def test_stage2_mixed_dtypes_matches_stage1():
    """Stage 2 with G > 1 on params of two dtypes: the fp32 buffer is divided once at the end
    and the bf16 buffer is pre-scaled, each bucket by its own divisor; the update equals
    stage 1's, which reduces the same accumulated gradients once."""
    params = {
        "w": jnp.asarray(np.random.default_rng(0).standard_normal((6, 4)) * 0.3, jnp.float32),
        "b": jnp.zeros((4,), jnp.bfloat16),
    }

    def loss_fn(p, batch):
        pred = batch["x"] @ p["w"] + p["b"].astype(jnp.float32)
        return jnp.mean((pred - batch["y"]) ** 2)

    batch = make_batch(48)
    out = []
    for stage in (1, 2):
        cfg = DDPConfig(zero_stage=stage, num_microbatches=3, grad_reduce_in_fp32=True)
        dp = DataParallel(loss_fn, optax.sgd(0.1), cfg)
        state = dp.init(params)
        state, _ = dp.step(state, dp.shard_batch(batch))
        out.append(dp.params(state))
    np.testing.assert_allclose(out[0]["w"], out[1]["w"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(
        np.asarray(out[0]["b"], np.float32), np.asarray(out[1]["b"], np.float32)
    )


@pytest.mark.parametrize("dp_size", [6, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_init_compiles_one_program(stage, dp_size):
    """``init`` compiles its own program and nothing else: uncommitted single-device params
    are replicated onto the mesh first, where ``jit`` would have jax split each array with a
    slicing program compiled per distinct shape. Host (NumPy) params are split on the host,
    and both give the same state. (A model of 64 or more repeated leaves compiles one small
    program per kind of leaf instead: ``tests/test_state_build.py``.)"""
    shapes = {"a": (40, 24), "b": (24,), "c": (24, 16), "d": (16,)}  # no other test has these
    rng = np.random.default_rng(stage)
    host = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    mesh = make_mesh(devices=jax.devices()[:dp_size])
    dp = DataParallel(mse_loss, optax.adam(1e-2), DDPConfig(zero_stage=stage), mesh=mesh)
    params = jax.tree.map(jnp.asarray, host)
    assert not jax.tree.leaves(params)[0].committed
    with counting_compiles() as compiles:
        state = dp.init(params)
    assert len(compiles) == 1
    cfg = DDPConfig(zero_stage=stage)
    from_host = DataParallel(mse_loss, optax.adam(1e-2), cfg, mesh=mesh).init(host)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(from_host), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_init_traces_the_state_once(stage, monkeypatch):
    """``init`` traces the state once: its ``eval_shape`` (for the ``out_shardings``) and the
    ``jit`` that builds the state share jax's trace cache, which a change to either call's
    arguments would break (tracing AdamW's ``init`` costs 1.3 s at 1,000 parameters on a
    2-core CPU). The state carries exactly the shardings ``state_shardings`` reports, and the
    abstract state its shapes. (Putting a sharding constraint on every leaf inside the traced
    function instead of ``out_shardings`` cost more in tracing and in XLA than it saved.)"""
    import jaxdp._src.strategy.strategy as strategy_module

    calls = []
    init_state = strategy_module.Strategy.init_state
    monkeypatch.setattr(
        strategy_module.Strategy,
        "init_state",
        lambda self, p: calls.append(1) or init_state(self, p),
    )
    dp = DataParallel(mse_loss, optax.adamw(1e-2), DDPConfig(zero_stage=stage))
    state = dp.init(mlp_params())
    assert calls == [1]
    for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(dp.state_shardings), strict=True):
        assert x.sharding.is_equivalent_to(sh, x.ndim), (x.shape, x.sharding, sh)
    abstract = jax.eval_shape(lambda: state)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), dp.abstract_state) == jax.tree.map(
        lambda a: (a.shape, a.dtype), abstract
    )


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_last_microbatch_peeled_only_where_collectives_follow(stage):
    """Stages 0-1 run the last of ``G`` micro-batches outside the loop, so that its backward
    overlaps the collectives after it (``Kernel.peel_last``): the model appears twice in the
    program. With one rank there are no collectives (and with ``overlap_grad_reduce=False``
    no overlap is wanted), and the model appears once, as at
    ``G = 1`` (one H200, 303M GPT, G = 4: the peeled stage 1 compiled in 1.94x of the bare
    step's time). Stage 2 reduce-scatters inside every micro-batch's backward: never peeled."""

    def dots(devices, g, **kw):
        cfg = DDPConfig(zero_stage=stage, num_microbatches=g, bucket_size=150, **kw)
        dp = DataParallel(mse_loss, optax.adamw(1e-3), cfg, mesh=make_mesh(devices))
        state = dp.init(mlp_params())
        text = dp.step.lower(state, dp.shard_batch(make_batch(64))).as_text()
        return text.count("stablehlo.dot_general")

    one = jax.devices()[:1]
    once = dots(one, 1)
    assert once > 0
    assert dots(one, 4) == once
    assert dots(jax.devices(), 4) == (2 * once if stage < 2 else once)
    # No overlap wanted (Megatron's overlap_grad_reduce=False): nothing peeled either.
    assert dots(jax.devices(), 4, overlap_grad_reduce=False) == once


@pytest.mark.parametrize(
    ("stage", "n", "clip", "overlap", "holds", "g"),
    [
        (0, 1, None, False, True, 1),
        (1, 1, None, False, True, 1),
        (2, 1, None, False, True, 1),
        (3, 1, None, False, True, 1),
        (2, 1, None, False, True, 4),
        (0, 8, None, False, False, 1),
        (0, 6, 1.0, False, False, 1),
        (1, 8, 1.0, False, False, 1),
        (3, 8, None, False, False, 1),
        (3, 3, 1.0, False, True, 1),
        (3, 6, 1.0, False, True, 1),
        (3, 6, 1.0, False, True, 4),
        (2, 6, 1.0, True, True, 1),
        (1, 8, None, True, False, 1),
    ],
)
def test_a_donated_step_holds_the_params_until_the_norm(stage, n, clip, overlap, holds, g):
    """Where the strategy says (``Strategy.holds_params``: one rank; or clipping, which makes
    the update wait for the norm anyway, with the params sharded, so that holding them costs
    little memory), a donated step passes the optimizer's target through one
    ``optimization_barrier`` with the old params and the gradient norm
    (:func:`jaxdp._src.comm.order.hold`), so that XLA leaves their buffers alone until the backward
    pass ends. The barrier is an identity: the step is the same bit for bit as an engine's
    that does not donate (and so does not hold), at dp 3 and 6 too (padded shards), and with
    micro-batches."""

    def engine(donate=True):
        extra = {"overlap_param_gather": True} if overlap else {}
        cfg = DDPConfig(
            zero_stage=stage, bucket_size=150, clip_grad=clip, num_microbatches=g, **extra
        )
        mesh = make_mesh(jax.devices()[:n])
        return DataParallel(mse_loss, optax.adamw(1e-3), cfg, mesh=mesh, donate=donate)

    def barriers(dp):
        state = dp.init(mlp_params())
        text = dp.step.lower(state, dp.shard_batch(make_batch(48))).as_text()
        return len(re.findall(r"stablehlo\.optimization_barrier", text))

    held, plain = engine(), engine(donate=False)
    assert barriers(held) == barriers(plain) + holds
    assert held.plan.strategy.holds_params == holds

    runs = []
    for dp in (held, plain):
        state = dp.init(mlp_params())
        for seed in range(2):
            state, metrics = dp.step(state, dp.shard_batch(make_batch(48, seed=seed)))
        runs.append((jax.tree.leaves(dp.params(state)), float(metrics["grad_norm"])))
    for a, b in zip(runs[0][0], runs[1][0], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert runs[0][1] == runs[1][1]
