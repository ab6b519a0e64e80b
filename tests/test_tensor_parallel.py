"""DataParallel on data x model meshes: Megatron-style tensor-parallel params keep their specs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import max_rel_err, reference_train, train_steps
from _tp_models import (
    SPECS,
    compiled_collectives,
    lowered_collectives,
    place,
    tp_batch,
    tp_loss,
    tp_params,
)
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp import DataParallel, DDPConfig

STEPS, G, BATCH = 5, 2, 16
MESHES = [(4, 2), (2, 4)]


def tp_mesh(data, model, devices=None):
    devs = np.asarray(devices or jax.devices()[: data * model]).reshape(data, model)
    return jax.sharding.Mesh(devs, ("data", "model"))


def engine(mesh, opt=None, **cfg):
    opt = opt or optax.adamw(1e-2, weight_decay=0.1)
    cfg = {"num_microbatches": G, "bucket_size": 300} | cfg
    return DataParallel(tp_loss, opt, DDPConfig(**cfg), mesh=mesh), opt


@pytest.fixture(scope="module")
def batches():
    return [tp_batch(BATCH, seed=s) for s in range(STEPS)]


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("shape", MESHES, ids=["data4xmodel2", "data2xmodel4"])
def test_parity_with_single_device(batches, stage, shape):
    mesh = tp_mesh(*shape)
    dp, opt = engine(mesh, zero_stage=stage)
    ref, ref_norms = reference_train(tp_loss, opt, tp_params(), batches)
    state = dp.init(place(tp_params(), mesh))
    assert len(dp.layout.buckets) >= 3
    if stage == 0:  # no metric waits on a bucket split over the model axis (order_metrics)
        assert dp.plan.strategy.make_kernel.keywords["order_metrics"] is False
    state, norms = train_steps(dp, state, batches)
    # fp32 throughout: only summation orders differ (per-rank partial sums, the model's own
    # row-parallel all-reduces), as in tests/test_engine_parity.py.
    assert max_rel_err(dp.params(state), ref) < 1e-6
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    # The working params still carry the model axis, exactly as given.
    for x, spec in zip(jax.tree.leaves(state.params), jax.tree.leaves(SPECS), strict=True):
        assert _full(x.sharding.spec, x.ndim) == _full(spec, x.ndim)
    if stage >= 1:
        # Master weights: [model blocks, ZeRO view] sharded over model and data.
        wq = state.master["attn"]["wq"]
        assert wq.sharding.spec == P("model", "data")
        assert wq.addressable_shards[0].data.shape == (1, D_LOCAL(shape))
        assert state.master["attn"]["bo"].sharding.spec == P("data")


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("shape", MESHES, ids=["data4xmodel2", "data2xmodel4"])
def test_zero3_parity_with_single_device(batches, g, shape):
    """ZeRO-3 on a data x model mesh: the working params are sharded like the master weights
    ([model blocks, ZeRO view] over model and data) and gathered over the data axis inside the
    step, each device gathering its own model block; fp32 parity as at stages 0-2."""
    mesh = tp_mesh(*shape)
    dp, opt = engine(mesh, zero_stage=3, num_microbatches=g, check_for_nan_in_grad=True)
    ref, ref_norms = reference_train(tp_loss, opt, tp_params(), batches)
    state = dp.init(place(tp_params(), mesh))
    wq = state.params["attn"]["wq"]
    assert wq.sharding.spec == P("model", "data")
    assert wq.addressable_shards[0].data.shape == (1, D_LOCAL(shape))
    assert state.params["attn"]["bo"].sharding.spec == P("data")
    state, norms = train_steps(dp, state, batches)
    assert max_rel_err(dp.params(state), ref) < 1e-6
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)


@pytest.mark.parametrize("g", [1, 2])
def test_zero3_with_bf16_params_matches_stage2(batches, g):
    """Stage 3 with bf16 working params on a data x model mesh: the nested regions keep one
    accumulator per bucket, and the gathers' transpose must reduce into those (it once expected
    one per parameter, as on a 1-D mesh, and failed to trace). Stage 2 reduces the same bf16
    gradients with the same wire; the fp32 sums group differently (in the gathers' transpose),
    so the fp32 master agrees to fp32 rounding. Momentum SGD, not Adam: Adam turns a last-bit
    difference of a near-zero gradient into a step of lr; SGD keeps it at lr x 5.6 x a few
    fp32 ulps of the gradient after 3 steps (allowed: 1e-7 absolute)."""
    mesh = tp_mesh(4, 2)
    out = {}
    for stage in (2, 3):
        opt = optax.sgd(1e-2, momentum=0.9)
        dp, _ = engine(mesh, opt, zero_stage=stage, num_microbatches=g, param_dtype="bfloat16")
        state = dp.init(place(tp_params(), mesh))
        state, norms = train_steps(dp, state, batches[:3])
        out[stage] = (dp.params(state), norms)
    np.testing.assert_allclose(out[3][1], out[2][1], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out[2][0]), jax.tree.leaves(out[3][0]), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-7)


@pytest.mark.parametrize("stage", [1, 2])
def test_overlap_param_gather_on_a_2d_mesh(batches, stage):
    """overlap_param_gather keeps the working params sharded between steps on a data x model
    mesh too and gathers them (per device block) at the start of the next step."""
    mesh = tp_mesh(4, 2)
    dp, opt = engine(mesh, zero_stage=stage, overlap_param_gather=True)
    ref, _ = reference_train(tp_loss, opt, tp_params(), batches[:3])
    state = dp.init(place(tp_params(), mesh))
    assert state.params["attn"]["wq"].sharding.spec == P("model", "data")
    for b in batches[:3]:
        state, _ = dp.step(state, dp.shard_batch(b))
    assert max_rel_err(dp.params(state), ref) < 1e-6


def D_LOCAL(shape):
    data, model = shape
    return 16 * 16 // model // data


def _full(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


def _state_bytes(tree):
    """Bytes each device holds of every leaf of ``tree`` (device 0's shards)."""
    dev = jax.devices()[0]
    return [
        sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
        for x in jax.tree.leaves(tree)
    ]


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("shape", MESHES, ids=["data4xmodel2", "data2xmodel4"])
def test_bytes_per_device_are_one_over_model(stage, shape):
    """Per device, every split param's working copy, fp32 master and Adam moments take 1/|model|
    of what the same data-parallel run on a 1-D mesh holds; replicated ones are unchanged."""
    data, model = shape
    cfg = {"zero_stage": stage, "param_dtype": "bfloat16"}
    dp2, _ = engine(tp_mesh(data, model), **cfg)
    s2 = dp2.init(place(tp_params(), dp2.mesh))
    dp1, _ = engine(jaxdp.make_mesh(jax.devices()[:data]), **cfg)
    s1 = dp1.init(tp_params())
    split = [len(jaxdp._src.topology.sharding.spec_axes(s)) > 0 for s in jax.tree.leaves(SPECS)]
    for part in ("params", "master", "opt_state"):
        b2, b1 = _state_bytes(getattr(s2, part)), _state_bytes(getattr(s1, part))
        flags = split
        if part == "opt_state":  # adamw: the step count, then mu and nu of every param
            assert b2[0] == b1[0] == 4
            b2, b1, flags = b2[1:], b1[1:], split * 2
        assert len(b2) == len(b1) == len(flags)
        for x2, x1, sp in zip(b2, b1, flags, strict=True):
            assert x2 * (model if sp else 1) == x1, (part, x2, x1)
        total2, total1 = sum(b2), sum(b1)
        split_bytes = sum(x for x, sp in zip(b1, flags) if sp)
        assert total2 == total1 - split_bytes + split_bytes // model


@pytest.mark.parametrize(("stage", "g"), [(0, 2), (1, 2), (2, 1), (2, 2)])
def test_one_collective_per_bucket_over_data_only(stage, g):
    mesh = tp_mesh(4, 2)
    dp, _ = engine(mesh, zero_stage=stage, num_microbatches=g, clip_grad=1.0)
    state = dp.init(place(tp_params(), mesh))
    batch = dp.shard_batch(tp_batch(BATCH))
    n = len(dp.layout.buckets)
    lowered = dp.step.lower(state, batch)
    ops = lowered_collectives(lowered.as_text())
    data_groups = [(0, 2, 4, 6), (1, 3, 5, 7)]
    # jaxdp's own collectives are all over the data axis (groups of size dp, one per model rank).
    assert all(groups == data_groups for _, groups in ops), ops
    names = ("all_reduce", "reduce_scatter", "all_gather")
    count = {op: sum(o == op for o, _ in ops) for op in names}
    if stage == 0:
        assert count == {"all_reduce": n + 1, "reduce_scatter": 0, "all_gather": 0}
    else:
        # stage 2 with G > 1 reduce-scatters every micro-batch, all of them in the scan body
        # (none peeled out: Kernel.peel_last), so once per bucket in the program text too
        assert count == {"all_reduce": 2, "reduce_scatter": n, "all_gather": n}
    # Compiled: packing the model-sharded gradients into buckets moves nothing between model
    # ranks. Collectives over the model axis are all-reduces of activations and scalars (the
    # model's own tensor parallelism and the squared-norm sum), no more than a plain jit.
    compiled = compiled_collectives(lowered.compile().as_text())
    model_groups = [(0, 1), (2, 3), (4, 5), (6, 7)]
    over_model = [(op, k) for op, k, gr in compiled if gr == model_groups]
    assert {op for op, _ in over_model} <= {"all-reduce"}, over_model
    assert all(gr in (model_groups, data_groups) for _, _, gr in compiled), compiled

    def plain(p, b):
        return jax.grad(tp_loss)(p, b)

    ref = jax.jit(plain).lower(place(tp_params(), dp.mesh), batch).compile().as_text()
    ref_elems = sum(k for op, k, gr in compiled_collectives(ref) if gr == model_groups)
    params_elems = sum(math.prod(x.shape) for x in jax.tree.leaves(tp_params()))
    assert sum(k for _, k in over_model) <= ref_elems + 8 < params_elems
    data_rs = [k for op, k, gr in compiled if gr == data_groups and op == "reduce-scatter"]
    assert len(data_rs) == (0 if stage == 0 else n)


def test_replicated_params_on_a_2d_mesh_are_unchanged():
    """Params given without a sharding are replicated over model, as on a 1-D mesh."""
    mesh = tp_mesh(4, 2)
    dp, opt = engine(mesh, zero_stage=1)
    state = dp.init(tp_params())
    assert all(x.sharding.spec == P() for x in jax.tree.leaves(state.params))
    b = tp_batch(BATCH)
    ref, _ = reference_train(tp_loss, opt, tp_params(), [b])
    state, _ = dp.step(state, dp.shard_batch(b))
    assert max_rel_err(dp.params(state), ref) < 1e-6


def test_param_specs_under_eval_shape():
    mesh = tp_mesh(4, 2)
    dp, _ = engine(mesh, zero_stage=1)
    abstract = jax.eval_shape(lambda p: dp.init(p, param_specs=SPECS), tp_params())
    assert abstract.master["mlp"]["up"].shape == (2, 16 * 16)
    assert dp.state_shardings.params["mlp"]["up"].spec == P(None, "model")
    # A later eval_shape without specs reuses the plan of the first init.
    jax.eval_shape(dp.init, tp_params())
    assert dp.state_shardings.master["mlp"]["up"].spec == P("model", "data")


def test_errors():
    mesh = tp_mesh(4, 2)
    with pytest.raises(ValueError, match=r"expected one named 'data' \(DDPConfig.data_axis\)"):
        DataParallel(tp_loss, optax.sgd(0.1), DDPConfig(), mesh=jax.make_mesh((8,), ("batch",)))
    dp, _ = engine(mesh, zero_stage=1)
    bad = dict(SPECS, mlp=dict(SPECS["mlp"], up=P("data", "model")))
    with pytest.raises(ValueError, match=r"param 'mlp/up' is sharded over the data axis 'data'"):
        dp.init(place(tp_params(), mesh, bad))
    with pytest.raises(ValueError, match=r"over axis 'expert'.*does not have"):
        dp.init(tp_params(), param_specs=dict(SPECS, mlp=dict(SPECS["mlp"], up=P("expert"))))
    uneven = jax.tree.map(lambda s: s, SPECS)
    uneven["attn"]["bo"] = P("model")
    params = tp_params()
    params["attn"]["bo"] = jnp.zeros((15,))
    with pytest.raises(ValueError, match=r"'attn/bo' has a dimension of size 15 split over"):
        dp.init(params, param_specs=uneven)
    mg, _ = engine(mesh, zero_stage=1, bucket_layout="megatron")
    with pytest.raises(NotImplementedError, match="bucket_layout='megatron'"):
        mg.init(place(tp_params(), mesh))


def test_blocks_follow_device_order_on_a_3d_mesh():
    """Row m of the block form is the block of the devices at mixed-radix position m over the
    spec's axes (first-named major), for specs naming two axes in either order or together."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "a", "b"))
    x = jnp.arange(8 * 12, dtype=jnp.float32).reshape(8, 12)
    for spec in (P("b", "a"), P(("a", "b"), None), P(None, ("b", "a"))):
        arr = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
        plan = jaxdp._src.topology.sharding.ShardingPlan.from_params({"x": arr}, mesh, "data")
        ls = plan.leaves[0]
        blocks = plan.to_blocks(x, ls)
        coords = {
            d: dict(zip(mesh.axis_names, np.argwhere(mesh.devices == d)[0])) for d in jax.devices()
        }
        for shard in arr.addressable_shards:
            c = coords[shard.device]
            m = 0
            for ax in ls.axes:
                m = m * mesh.shape[ax] + int(c[ax])
            np.testing.assert_array_equal(blocks[m], shard.data)
        np.testing.assert_array_equal(plan.from_blocks(blocks, ls), x)


@pytest.mark.parametrize("stage", [0, 2])
def test_parity_on_a_3d_mesh_with_two_model_axes(batches, stage):
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "a", "b"))
    specs = {
        "attn": {
            "wq": P(None, ("a", "b")),
            "wk": P("b", "a"),
            "wv": P(None, "a"),
            "wo": P(("b", "a"), None),
            "bo": P("b"),
        },
        "mlp": {"up": P("a", "b"), "up_b": P(("a", "b")), "down": P("b", None), "down_b": P()},
    }
    dp, opt = engine(mesh, zero_stage=stage)
    ref, _ = reference_train(tp_loss, opt, tp_params(), batches[:3])
    state = dp.init(place(tp_params(), mesh, specs))
    for b in batches[:3]:
        state, _ = dp.step(state, dp.shard_batch(b))
    assert max_rel_err(dp.params(state), ref) < 1e-6
    assert state.params["attn"]["wk"].sharding.spec == P("b", "a")


def test_checkpoint_restores_across_tp_and_1d_meshes(tmp_path, batches):
    """A checkpoint of a data4 x model2 ZeRO-1 run stores whole params; it restores exactly into
    the same engine, into data2 x model4 at stage 2, and into a 1-D mesh at stage 0."""
    src, _ = engine(tp_mesh(4, 2), zero_stage=1)
    state = src.init(place(tp_params(), src.mesh))
    for b in batches[:2]:
        state, _ = src.step(state, src.shard_batch(b))
    saved = jax.tree.map(np.asarray, src.params(state))
    with jaxdp.CheckpointManager(tmp_path, src) as ckpt:
        ckpt.save(2, state)
        ckpt.wait_until_finished()
    state, _ = src.step(state, src.shard_batch(batches[2]))
    expect = src.params(state)

    dst_tp, _ = engine(tp_mesh(2, 4), zero_stage=2)
    dst_1d, _ = engine(jaxdp.make_mesh(), zero_stage=0)
    # Engines that never saw the params: an abstract init (param_specs: tracers carry none).
    jax.eval_shape(lambda p: dst_tp.init(p, param_specs=SPECS), tp_params())
    jax.eval_shape(dst_1d.init, tp_params())
    for dst in (src, dst_tp, dst_1d):
        with jaxdp.CheckpointManager(tmp_path, dst) as ckpt:
            restored = ckpt.restore()
        jax.tree.map(np.testing.assert_array_equal, dst.params(restored), saved)
        if dst is dst_tp:
            assert restored.params["mlp"]["up"].sharding.spec == P(None, "model")
        restored, _ = dst.step(restored, dst.shard_batch(batches[2]))
        assert max_rel_err(dst.params(restored), expect) < 1e-6


@pytest.mark.parametrize("stage", [0, 1])
def test_layouts_of_replicated_params_are_unchanged(stage):
    """Checkpoints and jit caches compare layouts: whole params lay out exactly as before,
    whether the mesh is 1-D or has other axes."""
    cfg = DDPConfig(zero_stage=stage, bucket_size=300)
    base = jaxdp.BucketLayout.from_params(tp_params(), cfg, 4)
    same = jaxdp.BucketLayout.from_params(tp_params(), cfg, 4, shard_axes=((),) * 9)
    assert same == base and hash(same) == hash(base)
    assert all(b.shard_axes == () for b in base.buffers)
    dp = DataParallel(tp_loss, optax.sgd(0.1), cfg, mesh=tp_mesh(4, 2))
    dp.init(tp_params())
    assert dp.layout == base
    split = DataParallel(tp_loss, optax.sgd(0.1), cfg, mesh=tp_mesh(4, 2))
    split.init(tp_params(), param_specs=SPECS)
    assert split.layout != base
    assert {b.shard_axes for b in split.layout.buffers} == {(), ("model",)}


@pytest.mark.parametrize(
    "kw",
    [
        {
            "zero_stage": 1,
            "deterministic_reduction": True,
            "check_for_nan_in_grad": True,
            "clip_grad": 0.5,
        },
        {"zero_stage": 2, "param_dtype": "bfloat16", "reduce_scatter_with_fp32_accumulation": True},
    ],
    ids=["deterministic+nan-check+clip", "bf16-fp32-accum"],
)
def test_other_options_on_a_2d_mesh(batches, kw):
    mesh = tp_mesh(4, 2)
    bf16 = "param_dtype" in kw
    # bf16: momentum SGD, as in test_engine_parity.test_bf16_params_parity. AdamW's first step
    # is +-lr whatever |g|, and a gradient near 0 that bf16 computes with the other sign on one
    # side (wo[7, 13]: -1.8e-4 in fp32, bf16 compute error ~1.5e-4) differs by 2 lr = 2e-2.
    dp, opt = engine(mesh, opt=optax.sgd(0.1, momentum=0.9) if bf16 else None, **kw)
    ref, _ = reference_train(
        tp_loss,
        opt,
        tp_params(),
        batches[:2],
        clip=kw.get("clip_grad"),
        param_dtype=jnp.bfloat16 if bf16 else None,
    )
    state = dp.init(place(tp_params(), mesh))
    for b in batches[:2]:
        state, _ = dp.step(state, dp.shard_batch(b))
    if bf16:  # bf16 gradient rounding, as in test_engine_parity.test_bf16_params_parity
        for a, r in zip(jax.tree.leaves(dp.params(state)), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(a, r, atol=2e-3, rtol=0)
    else:
        assert max_rel_err(dp.params(state), ref) < 1e-6


@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_keeps_the_model_split(tmp_path, capfd, stage):
    """A checkpoint's parameter-shaped arrays (params, master, Adam's moments) keep their
    weight's split over ``model`` and take ``data`` on a free dimension: moving a model-split
    weight to a data split of the same dimension made XLA gather every whole weight on every
    device while saving ("involuntary full rematerialization")."""
    from jaxdp import CheckpointManager

    mesh = tp_mesh(2, 4)
    dp, _ = engine(mesh, zero_stage=stage, param_dtype="bfloat16")
    state = dp.init(place(tp_params(), mesh))
    capfd.readouterr()
    with CheckpointManager(tmp_path, dp) as ckpt:
        ckpt.save(0, state)
        ckpt.wait_until_finished()
        abstract = jax.eval_shape(ckpt._canonical_fn, state)
        canonical = ckpt._canonical_shardings(abstract)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    specs = jax.tree.leaves(SPECS, is_leaf=lambda x: isinstance(x, P))
    for name in ("params", "master"):
        for k, want in zip(sorted(canonical[name]), specs, strict=True):
            ndim = abstract[name][k].ndim
            got, model = _full(canonical[name][k].spec, ndim), _full(want, ndim)
            assert "data" in got or all(model), (name, got)  # unless no dimension is free
            assert all(m is None or g == m for g, m in zip(got, model)), (name, got, model)
