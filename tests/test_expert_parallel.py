"""Expert data parallelism on data=2 x expert=4: expert buffers reduce over the expert-DP group."""

import importlib.util
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import capture_grads
from _tp_models import lowered_collectives
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp import DataParallel, DDPConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SEQ, D = 16, 4, 8


def _example():
    name = "moe_expert_parallel"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(ROOT, "examples", f"{name}.py")
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # flax linen modules are dataclasses: they look themselves up
        spec.loader.exec_module(mod)
    return sys.modules[name]


def ep_mesh():
    return jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "expert"))


@pytest.fixture(scope="module")
def setup():
    ex = _example()
    ep, ref = ex.models()
    params = ref.init(jax.random.key(0), jnp.zeros((1, SEQ, D)))["params"]
    rng = np.random.default_rng(1)
    batch = {
        "x": jnp.asarray(rng.standard_normal((BATCH, SEQ, D)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((BATCH, SEQ, D)), jnp.float32),
        "m": jnp.asarray(rng.random((BATCH, SEQ, 1)) < 0.6, jnp.float32),
    }
    return ex, ep, ref, params, batch


def per_token_loss(model):
    def loss_fn(params, b):
        err = (model.apply({"params": params}, b["x"]) - b["y"]) ** 2 * b["m"]
        return jnp.sum(err), jnp.sum(b["m"]) * D

    return loss_fn


MODES = {
    "default": {},
    "avg": {"average_in_collective": True},
    "per_token": {"calculate_per_token_loss": True},
    "fp32_wire_g2": {"grad_reduce_in_fp32": True, "num_microbatches": 2},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_gradients_equal_single_device_mean_over_tokens(setup, mode):
    ex, ep, ref, params, batch = setup
    kw = MODES[mode]
    per_token = kw.get("calculate_per_token_loss", False)
    cfg = DDPConfig(expert_axis="expert", expert_param_patterns=("moe/w_*",), **kw)
    loss = per_token_loss(ep) if per_token else ex.mse(ep)
    dp = DataParallel(loss, capture_grads(), cfg, mesh=ep_mesh())
    state = dp.init(params)
    state, metrics = dp.step(state, dp.shard_batch(batch))
    grads = state.opt_state

    if per_token:

        def global_mean(p):
            s, n = per_token_loss(ref)(p, batch)
            return s / n

        want = jax.grad(global_mean)(params)
    else:
        want = jax.grad(ex.mse(ref))(params, batch)
    for path in (("moe", "w_in"), ("moe", "w_out"), ("moe", "router"), ("embed", "kernel")):
        g, w = grads[path[0]][path[1]], want[path[0]][path[1]]
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-7, err_msg=str(path))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-7)
    # Expert weights stay split over the expert axis; the norm counts every expert once.
    assert state.params["moe"]["w_in"].sharding.spec == P("expert", None, None)
    norm = float(jnp.sqrt(sum(jnp.sum(w**2) for w in jax.tree.leaves(want))))
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-5)


@pytest.mark.parametrize("by", ["pattern", "sharding"])
def test_expert_buffers_reduce_over_the_expert_dp_group_only(setup, by):
    ex, ep, _, params, batch = setup
    mesh = ep_mesh()
    if by == "pattern":
        cfg = DDPConfig(expert_axis="expert", expert_param_patterns=("*/w_in", "*/w_out"))
    else:  # the params' own sharding over the expert axis marks them
        cfg = DDPConfig(expert_axis="expert")
        params = jax.tree_util.tree_map_with_path(
            lambda kp, x: jax.device_put(
                x,
                NamedSharding(mesh, P("expert") if "w_" in jax.tree_util.keystr(kp) else P()),
            ),
            params,
        )
    cfg = cfg.replace(bucket_size=200)  # several buckets in each buffer
    dp = DataParallel(ex.mse(ep), optax.sgd(0.1), cfg, mesh=mesh)
    state = dp.init(params)
    layout = dp.layout
    expert = [b for b in layout.buckets if layout.buffers[b.buffer].shard_axes == ("expert",)]
    dense = [b for b in layout.buckets if not layout.buffers[b.buffer].shard_axes]
    assert len(expert) >= 2 and len(dense) >= 2 and len(layout.buffers) == 2
    assert {p for b in expert for p in b.param_paths} == {"moe/w_in", "moe/w_out"}
    # Per rank: 2 of the 8 experts.
    assert sum(b.numel for b in expert) == 2 * (D * 16 + 16 * D)

    ops = lowered_collectives(dp.step.lower(state, dp.shard_batch(batch)).as_text())
    expert_dp = [(0, 4), (1, 5), (2, 6), (3, 7)]  # same expert index, both data ranks
    dense_dp = [tuple(range(8))]
    expert_ax = [(0, 1, 2, 3), (4, 5, 6, 7)]
    by_group = {}
    for op, groups in ops:
        key = "expert_dp" if groups == expert_dp else "dense" if groups == dense_dp else None
        key = key or ("expert_axis" if groups == expert_ax else str(groups))
        by_group.setdefault(key, []).append(op)
    # One all-reduce per expert parameter (XLA combines them into buckets:
    # jaxdp._src.comm.per_param.AllReduceOps) over the expert-DP group (size 2) and nothing else
    # there.
    assert dp.plan.strategy.reduces_per_parameter
    n_expert, n_dense = (sum(len(b.slots) for b in bs) for bs in (expert, dense))
    assert by_group["expert_dp"] == ["all_reduce"] * n_expert
    # Dense parameters and the loss mean over all 8 ranks.
    assert by_group["dense"] == ["all_reduce"] * (n_dense + 1)
    # Over the expert axis: the layer's own dispatch (all_gather / reduce_scatter, forward and
    # backward) and the experts' squared-norm sum.
    assert set(by_group) == {"expert_dp", "dense", "expert_axis"}
    assert by_group["expert_axis"].count("all_reduce") == 1


def test_expert_errors(setup):
    ex, ep, _, params, _ = setup
    mesh = ep_mesh()
    with pytest.raises(ValueError, match=r"expert_param_patterns entry 'moe/experts' matches no"):
        cfg = DDPConfig(expert_axis="expert", expert_param_patterns=("moe/experts",))
        DataParallel(ex.mse(ep), optax.sgd(0.1), cfg, mesh=mesh).init(params)
    with pytest.raises(NotImplementedError, match=r"expert_axis='expert' with zero_stage=1"):
        DataParallel(ex.mse(ep), optax.sgd(0.1), DDPConfig(expert_axis="expert", zero_stage=1))
    with pytest.raises(ValueError, match=r"expected a mesh with axes 'data' and 'expert'"):
        DataParallel(ex.mse(ep), optax.sgd(0.1), DDPConfig(expert_axis="expert"))
    with pytest.raises(ValueError, match=r"expert_axis: got 'data'; expected a mesh axis other"):
        DDPConfig(expert_axis="data")
    with pytest.raises(ValueError, match=r"expert_param_patterns: .*expected an expert_axis"):
        DDPConfig(expert_param_patterns=("*",))
    with pytest.raises(TypeError, match=r"wrap a single pattern in a tuple"):
        DDPConfig(expert_axis="expert", expert_param_patterns="moe/*")
    cfg = DDPConfig(expert_axis="expert", expert_param_patterns=("moe/*",))
    assert DDPConfig.from_dict(cfg.to_dict()) == cfg
    assert re.search("expert_param_patterns:\n- moe/\\*", cfg.to_yaml())


def test_experts_with_tensor_parallel_dense_layers_on_a_3d_mesh(setup):
    """data=2 x expert=2 x model=2: the dense kernels split over model (compiler), experts over
    expert (manual); gradients still equal the single-device mean."""
    ex, _, ref, params, batch = setup
    ep = ex.Block(ex.MoE(8, expert_axis="expert", expert_shards=2))
    devs = np.asarray(jax.devices()).reshape(2, 2, 2)
    mesh = jax.sharding.Mesh(devs, ("data", "expert", "model"))
    specs = jax.tree.map(lambda _: P(), params)
    specs["embed"] = {"kernel": P(None, "model"), "bias": P("model")}
    specs["head"]["kernel"] = P("model", None)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    cfg = DDPConfig(expert_axis="expert", expert_param_patterns=("moe/w_*",))
    dp = DataParallel(ex.mse(ep), capture_grads(), cfg, mesh=mesh)
    state = dp.init(placed)
    state, _ = dp.step(state, dp.shard_batch(batch))
    want = jax.grad(ex.mse(ref))(params, batch)
    for g, w in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-7)
    assert state.params["embed"]["kernel"].sharding.spec == P(None, "model")
    assert {b.shard_axes for b in dp.layout.buffers} == {("model",), (), ("expert",)}


def test_checkpoint_round_trip_on_the_expert_mesh(setup, tmp_path):
    import jaxdp

    ex, ep, _, params, batch = setup
    cfg = DDPConfig(expert_axis="expert", expert_param_patterns=("moe/w_*",))
    dp = DataParallel(ex.mse(ep), optax.adam(1e-2), cfg, mesh=ep_mesh(), donate=False)
    state = dp.init(params)
    state, _ = dp.step(state, dp.shard_batch(batch))
    with jaxdp.CheckpointManager(tmp_path, dp) as ckpt:
        ckpt.save(1, state)
        ckpt.wait_until_finished()
        restored = ckpt.restore()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert restored.params["moe"]["w_in"].sharding.spec == P("expert", None, None)
