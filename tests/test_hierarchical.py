"""Hierarchical data parallelism (``num_distributed_optimizer_instances``): the same training as
the single-device reference and the flat engine, state sharded within (or, with
``outer_dp_sharding_strategy="optim"``, across) instances, clear errors, and a compiled program
whose cross-instance gradient collectives run once per step on 1/(dp/N) of the bytes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import capture_grads, make_batch, max_rel_err, mlp_params, mse_loss, reference_train

import jaxdp
from jaxdp import DataParallel, DDPConfig

# Widths that 2, 3, 4, 6 and 8 do not all divide: every layout pads, so a lost trailing
# shard (Megatron#6048) would show as a gradient that differs from the reference.
SIZES = (5, 13, 7, 3)


def _params():
    return mlp_params(sizes=SIZES)


def _batches(n, steps=3):
    return [make_batch(n, seed=s, sizes=SIZES) for s in range(steps)]


def _token_loss(params, batch):
    """Per-token form: the sum over this micro-batch's elements and their count."""
    err = mse_loss(params, batch) * batch["y"].size
    return err, jnp.asarray(batch["y"].size, jnp.float32)


def _engine(ndev, opt, **cfg):
    mesh = jaxdp.make_mesh(jax.devices()[:ndev])
    loss = _token_loss if cfg.get("calculate_per_token_loss") else mse_loss
    return DataParallel(loss, opt, DDPConfig(bucket_size=40, **cfg), mesh=mesh)


def _run(eng, batches):
    state, norms = eng.init(_params()), []
    for b in batches:
        state, m = eng.step(state, eng.shard_batch(b))
        norms.append(float(m["grad_norm"]))
    return state, norms


# dp 8 with N = 2 is also run by the modes, two-level-mesh and compiled-program tests below
CASES = [(8, 4, 4), (6, 2, 4), (6, 3, 1)]


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("ndev", "n", "g"), CASES)
def test_matches_the_reference(ndev, n, g, stage, strategy):
    """SGD with momentum (not scale-invariant, so a wrong mean shows), fp32: only the summation
    order differs from one device. The reduced gradient itself is compared element by element
    (capture_grads): every element of every parameter, padded shards included."""
    batches = _batches(4 * ndev)
    cfg = dict(
        zero_stage=stage,
        num_microbatches=g,
        num_distributed_optimizer_instances=n,
        outer_dp_sharding_strategy=strategy,
    )
    opt = optax.sgd(0.1, momentum=0.9)
    eng = _engine(ndev, opt, **cfg)
    assert eng.dp == ndev and eng.group.outer_size == n
    state, norms = _run(eng, batches)
    ref, ref_norms = reference_train(mse_loss, opt, _params(), batches)
    assert max_rel_err(eng.params(state), ref) < 1e-6
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-6)
    # the gradient of one step, element by element
    cap = _engine(ndev, capture_grads(), **cfg)
    st = cap.init(_params())
    st, _ = cap.step(st, cap.shard_batch(batches[0]))
    grads = cap.plan.strategy.master_codec.from_view(st.opt_state)
    want = jax.grad(mse_loss)(_params(), batches[0])
    for got, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
@pytest.mark.parametrize(
    "mode",
    [
        {"grad_reduce_in_fp32": True},
        {"reduce_scatter_with_fp32_accumulation": True},
        {"deterministic_reduction": True},
        {"calculate_per_token_loss": True},
        {"average_in_collective": True},
        {"clip_grad": 0.05},
    ],
    ids=lambda m: next(iter(m)),
)
def test_modes_match_the_flat_engine(mode, strategy):
    """bf16 params: each mode's two levels against the flat engine's one, to bf16 rounding
    (the instance's sum is rounded to the wire dtype once more, as Megatron's is)."""
    batches = _batches(32)
    common = dict(zero_stage=2, num_microbatches=2, param_dtype="bfloat16", **mode)
    opt = optax.adamw(1e-2)
    flat_state, flat_norms = _run(_engine(8, opt, **common), batches)
    eng = _engine(
        8, opt, num_distributed_optimizer_instances=2, outer_dp_sharding_strategy=strategy, **common
    )
    state, norms = _run(eng, batches)
    flat = _engine(8, opt, **common)
    flat.init(_params())
    tol = jaxdp.testing.tolerance(jnp.bfloat16)
    assert max_rel_err(eng.params(state), flat.params(flat_state)) < 4 * tol
    np.testing.assert_allclose(norms, flat_norms, rtol=4 * tol)


@pytest.mark.parametrize(("strategy", "ways"), [("no_shard", 4), ("optim", 8)])
@pytest.mark.parametrize("stage", [1, 3])
def test_state_is_sharded_within_or_across_instances(stage, strategy, ways):
    eng = _engine(
        8,
        optax.adam(1e-3),
        zero_stage=stage,
        num_distributed_optimizer_instances=2,
        outer_dp_sharding_strategy=strategy,
    )
    state = eng.init(_params())
    assert eng.mesh.axis_names == ("data_outer", "data_inner")
    assert eng.mesh.devices.ravel().tolist() == jax.devices()[:8]  # instances: consecutive
    mu = state.opt_state[0].mu
    for leaf in jax.tree.leaves(mu) + jax.tree.leaves(state.master):
        shard = leaf.addressable_shards[0].data.shape[0]
        assert shard * ways == leaf.shape[0], (leaf.shape, shard)
        distinct = {(s.index[0].start or 0) for s in leaf.addressable_shards}
        assert len(distinct) == ways
    if stage == 3:
        for leaf in jax.tree.leaves(state.params):
            assert leaf.addressable_shards[0].data.shape[0] * ways == leaf.shape[0]


@pytest.mark.parametrize(
    ("cfg", "ndev", "match"),
    [
        (dict(zero_stage=0, num_distributed_optimizer_instances=2), 8, "zero_stage=1"),
        (dict(zero_stage=1, num_distributed_optimizer_instances=3), 8, "divisor of 8"),
        (dict(zero_stage=1, num_distributed_optimizer_instances=16), 8, "divisor of 8"),
        (dict(zero_stage=1, num_distributed_optimizer_instances=0), 8, "int >= 1"),
        (dict(zero_stage=1, num_distributed_optimizer_instances=2.0), 8, "int >= 1"),
        (dict(zero_stage=1, outer_dp_sharding_strategy="full"), 8, "no_shard"),
        (
            dict(zero_stage=1, num_distributed_optimizer_instances=2, expert_axis="expert"),
            8,
            "expert_axis",
        ),
    ],
)
def test_bad_settings_are_named(cfg, ndev, match):
    with pytest.raises((ValueError, TypeError), match=match) as e:
        _engine(ndev, optax.sgd(0.1), **cfg)
    assert "Fix" in str(e.value)


def test_tensor_parallel_mesh_is_refused():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    cfg = DDPConfig(zero_stage=1, num_distributed_optimizer_instances=2)
    with pytest.raises(ValueError, match="1-D mesh"):
        DataParallel(mse_loss, optax.sgd(0.1), cfg, mesh=mesh)


def test_engine_accepts_its_own_mesh():
    eng = _engine(8, optax.sgd(0.1), zero_stage=1, num_distributed_optimizer_instances=4)
    again = DataParallel(mse_loss, optax.sgd(0.1), eng.config, mesh=eng.mesh)
    assert again.mesh.shape == eng.mesh.shape
    with pytest.raises(ValueError, match="instances"):
        DataParallel(
            mse_loss,
            optax.sgd(0.1),
            eng.config.replace(num_distributed_optimizer_instances=2),
            mesh=eng.mesh,
        )


# ----------------------------------------------------------------------- the compiled program
def _groups(attr: str) -> list[list[int]]:
    """Replica groups of a collective: ``{{0,1},{2,3}}`` or the iota form
    ``[G,S]<=[dims]T(perm)``."""
    m = re.search(r"replica_groups=\{(\{[^=]*?\})\}", attr)
    if m:
        return [
            [int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attr)
    assert m, attr
    g, s = int(m.group(1)), int(m.group(2))
    dims = [int(v) for v in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
        ids = ids.transpose([int(v) for v in m.group(4).split(",")])
    return ids.reshape(g, s).tolist()


def _gradient_collectives(text: str):
    """(opcode, outside ENTRY (a loop body)?, replica groups, line) of every reduce-scatter,
    all-reduce and all-to-all of a compiled program's text."""
    out, entry = [], False
    for line in text.splitlines():
        if line and not line.startswith(" "):  # a computation's header (or its closing brace)
            entry = line.startswith("ENTRY")
        m = re.search(r"=.*? (reduce-scatter|all-reduce|all-to-all)(-start)?\(", line)
        scalars = re.match(r"\s*\S+ = \(?(\w+\[\](, )?)+\)? ", line)  # metrics, not gradients
        if m and not scalars:
            out.append((m.group(1), not entry, _groups(line), line))
    return out


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_compiled_outer_reduction_runs_once_per_step(h100, stage, strategy):
    """8 compile-only H100s, N = 2, G = 4: the gradient collectives over the instances run in
    the entry computation (not the micro-batch loop), over groups of one device per instance;
    those within an instance are over 4 consecutive devices; none spans all 8."""
    from jaxdp.aot import compile_step, example_mlp

    loss_fn, params, batch = example_mlp(4, 256, batch=64)
    cfg = DDPConfig(
        zero_stage=stage,
        num_microbatches=4,
        param_dtype="bfloat16",
        num_distributed_optimizer_instances=2,
        outer_dp_sharding_strategy=strategy,
    )
    mesh = jaxdp.make_mesh(list(h100.devices.ravel()))
    eng = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=mesh)
    compiled = compile_step(eng, params, batch)
    text = compiled.as_text()
    # jaxdp.aot's own report knows the level across instances
    from jaxdp.aot import collective_roles, schedule_report

    report = schedule_report(compiled)
    roles = collective_roles(report, eng)
    assert "grad outer" in roles and not any(r.startswith("grad outer (") for r in roles)
    if strategy == "optim":
        assert any(r.startswith("param outer") for r in roles)
    inner, outer = [], []
    for op, in_loop, groups, line in _gradient_collectives(text):
        sizes = {len(g) for g in groups}
        assert sizes != {8}, line  # nothing over every rank
        if sizes == {2}:
            assert groups == [[0, 4], [1, 5], [2, 6], [3, 7]], line
            outer.append((op, in_loop, line))
        elif sizes == {4}:
            assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]], line
            inner.append((op, in_loop, line))
    assert outer and inner
    # their input: the gradient bytes over the instance size (the inner reduce-scatter's shard)
    elements = 0
    for op, _, line in outer:
        shape = line.split("=", 1)[1].split(f" {op}")[0]
        moved = sum(int(n) for n in re.findall(r"\w+\[(\d+)\]", shape))
        if op == "reduce-scatter":  # an async start's shape is (inputs, outputs): 1.5 inputs
            moved = moved * 2 // 3 if f"{op}-start" in line else moved * 2
        elements += moved
    assert elements == sum(b.numel for b in eng.layout.buckets) // 4
    big = outer
    assert all(not in_loop for _, in_loop, _ in outer), outer  # once per step
    want = "reduce-scatter" if strategy == "optim" else "all-reduce"
    assert any(op == want for op, _, _ in big)
    if stage >= 2:  # stages 2-3 reduce within the instance in every micro-batch
        assert any(in_loop for _, in_loop, _ in inner)


# --------------------------------------------------------------- a two-level mesh you pass
def _pmean_loss(axes):
    """A loss with a model collective over the whole data-parallel group (``axes``): each
    prediction is centred on the global mean prediction, like a BatchNorm over the group."""

    def loss(params, batch):
        from _models import mlp_apply

        pred = mlp_apply(params, batch["x"])
        mu = jax.lax.pmean(jnp.mean(pred, axis=0), axes)
        return jnp.mean((pred - mu - batch["y"]) ** 2)

    return loss


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
@pytest.mark.parametrize("stage", [1, 3])
def test_two_level_data_axis_with_a_model_collective(stage, strategy):
    """MaxText's DCN x ICI mesh, data_axis=("dcn", "ici"): the instances are the mesh's outer
    axis, and a loss_fn collective over both names spans the whole group, as in the
    reference (which vmaps the same two names)."""
    mesh = jax.make_mesh((2, 4), ("dcn", "ici"))
    cfg = DDPConfig(
        zero_stage=stage,
        num_microbatches=2,
        bucket_size=40,
        data_axis=("dcn", "ici"),
        outer_dp_sharding_strategy=strategy,
    )
    loss = _pmean_loss(("dcn", "ici"))
    opt = optax.sgd(0.1, momentum=0.9)
    eng = DataParallel(loss, opt, cfg, mesh=mesh)
    assert eng.group.outer_size == 2 and eng.group.inner_size == 4
    batches = _batches(32)
    state, norms = _run(eng, batches)
    ref = jaxdp.testing.Reference(
        loss, opt, cfg.replace(num_distributed_optimizer_instances=2), dp=8
    )
    rs = ref.init(_params())
    ref_norms = []
    for b in batches:
        rs, m = ref.step(rs, b)
        ref_norms.append(float(m["grad_norm"]))
    assert max_rel_err(eng.params(state), rs.master) < 1e-6
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-6)


def test_two_level_data_axis_without_a_mesh_groups_the_devices():
    cfg = DDPConfig(zero_stage=2, data_axis=("dcn", "ici"), num_distributed_optimizer_instances=4)
    eng = DataParallel(mse_loss, optax.sgd(0.1), cfg)
    assert eng.mesh.axis_names == ("dcn", "ici") and eng.mesh.shape["dcn"] == 4
    assert DDPConfig.from_dict(cfg.to_dict()) == cfg  # YAML round trip keeps the pair


@pytest.mark.parametrize(
    ("cfg", "mesh_shape", "match"),
    [
        (dict(data_axis=("dcn", "ici")), None, "two-level mesh"),
        (dict(data_axis=("dcn", "ici")), ((8,), ("data",)), "axes"),
        (
            dict(data_axis=("dcn", "ici"), num_distributed_optimizer_instances=4),
            ((2, 4), ("dcn", "ici")),
            "instances",
        ),
        (dict(data_axis=("dcn", "dcn")), None, "two distinct names"),
        (dict(data_axis=("a", "b", "c")), None, "two distinct names"),
        (dict(data_axis=("dcn", "ici"), zero_stage=0), None, "zero_stage=1"),
    ],
)
def test_two_level_data_axis_errors(cfg, mesh_shape, match):
    cfg = {"zero_stage": 1, **cfg}
    with pytest.raises((ValueError, TypeError), match=match) as e:
        mesh = jax.make_mesh(*mesh_shape) if mesh_shape else None
        DataParallel(mse_loss, optax.sgd(0.1), DDPConfig(**cfg), mesh=mesh)
    assert "Fix" in str(e.value)


# ------------------------------------------------------------- with the other state features
def test_composes_with_bf16_moments_offload_and_spike_checks():
    """Instances with bf16 Adam moments, the optimizer state in host memory and both spike
    checks: the flat engine's training to fp32 rounding (the moments are rounded the same way
    on both), and a non-finite batch skipped with the state unchanged."""
    common = dict(
        zero_stage=1,
        num_microbatches=2,
        exp_avg_dtype="bfloat16",
        exp_avg_sq_dtype="bfloat16",
        optimizer_cpu_offload=True,
        grad_norm_skip_threshold=1e6,
        check_for_large_grads=True,
    )
    opt = optax.adamw(1e-2)
    batches = _batches(32)
    flat_eng = _engine(8, opt, **common)
    flat_state, flat_norms = _run(flat_eng, batches)
    eng = _engine(
        8, opt, num_distributed_optimizer_instances=2, outer_dp_sharding_strategy="optim", **common
    )
    state, norms = _run(eng, batches)
    np.testing.assert_allclose(norms, flat_norms, rtol=1e-5)
    assert max_rel_err(eng.params(state), flat_eng.params(flat_state)) < 1e-4
    mu = state.opt_state[0].mu
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(mu))
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(mu))
    bad = dict(batches[0], x=batches[0]["x"].at[0, 0].set(jnp.nan))
    before = [np.asarray(x) for x in jax.tree.leaves((state.master, state.opt_state))]
    after, m = eng.step(state, eng.shard_batch(bad))  # the state is donated
    assert int(m["skipped"]) == 1
    now = [np.asarray(x) for x in jax.tree.leaves((after.master, after.opt_state))]
    for a, b in zip(now, before, strict=True):
        np.testing.assert_array_equal(a, b)
