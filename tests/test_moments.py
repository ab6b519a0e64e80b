"""Adam's moments stored in bfloat16 (``DDPConfig.exp_avg_dtype`` / ``exp_avg_sq_dtype``).

Every moment leaf has the configured dtype and the optimizer state's sharding at stages 0-3;
its values are those of a plain single-device reference whose optimizer rounds the moments to
the same dtype after each update (built here, independently of jaxdp's policy), to float32
rounding; an optimizer with no Adam moments is refused naming the field; checkpoints keep the
dtype and restore into other device counts, stages and moment dtypes (cast); the optimizer
state per device is 4 bytes per parameter over dp at stages 1-3 (compile-only H100s); and a
150-step GPT run ends within 2% of the float32-moment loss.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_batch, mlp_apply, mlp_params, mse_loss

import jaxdp
from jaxdp import CheckpointManager, DataParallel, DDPConfig
from jaxdp.testing import Reference, assert_trees_close, tolerance

BF16, F32 = "bfloat16", "float32"
MOMENTS = {
    optax.ScaleByAdamState: {"mu": "exp_avg", "nu": "exp_avg_sq"},
    optax.ScaleByAmsgradState: {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "exp_avg_sq"},
    optax.ScaleByBeliefState: {"mu": "exp_avg", "nu": "exp_avg_sq"},
    optax.ScaleByLionState: {"mu": "exp_avg"},
}
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lamb": lambda: optax.lamb(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "adabelief": lambda: optax.adabelief(1e-2),
    "lion": lambda: optax.lion(1e-3),
}


def _is_state(x):
    return type(x) in MOMENTS


def _moments(opt_state):
    """``[(role, leaf)]`` of every moment leaf of ``opt_state``, in order."""
    out = []

    def visit(x):
        if _is_state(x):
            for name, role in MOMENTS[type(x)].items():
                out.extend((role, v) for v in jax.tree.leaves(getattr(x, name)))
        return x

    jax.tree.map(visit, opt_state, is_leaf=_is_state)
    return out


def rounding(opt, dtypes):
    """``opt`` with its moments rounded to ``dtypes[role]`` after init and every update, held
    in float32: what the engine computes, on one device, with no jaxdp code."""

    def rnd(state):
        def visit(x):
            if not _is_state(x):
                return x
            return x._replace(
                **{
                    name: jax.tree.map(
                        lambda v, d=dtypes[role]: v.astype(d).astype(v.dtype), getattr(x, name)
                    )
                    for name, role in MOMENTS[type(x)].items()
                    if role in dtypes
                }
            )

        return jax.tree.map(visit, state, is_leaf=_is_state)

    def update(grads, state, params=None):
        updates, state = opt.update(grads, state, params)
        return updates, rnd(state)

    return optax.GradientTransformation(lambda p: rnd(opt.init(p)), update)


def _engine(ndev, opt, **cfg):
    mesh = jaxdp.make_mesh(jax.devices()[:ndev])
    return DataParallel(mse_loss, opt, DDPConfig(**cfg), mesh=mesh)


def _canonical_moments(dp, state):
    """The engine's moments in their parameters' shapes, as stored."""
    return _moments(dp.plan.strategy.to_canonical(state)[2])


def _check_stored(dp, state, dtypes):
    """Every moment leaf at its configured dtype, sharded like the optimizer state."""
    moments = _moments(state.opt_state)
    assert set(dtypes) <= {role for role, _ in moments}
    for role, x in moments:
        assert x.dtype == jnp.dtype(dtypes.get(role, F32)), (role, x.dtype)
        if dp.config.zero_stage == 0:
            assert x.sharding.is_fully_replicated
        else:
            assert x.sharding.spec == jax.sharding.PartitionSpec("data"), x.sharding
            assert x.addressable_shards[0].data.size == x.size // dp.dp


def _assert_rounded_alike(got, want, dtype, rtol, what):
    """Stored moments against the reference's: to ``rtol`` where they are fp32, else equal
    but for elements one storage ulp apart (the engine's and the reference's fp32 values,
    equal to fp32 rounding, can straddle a rounding boundary), and those few (at most 1%)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == F32:
        assert_trees_close(got, want, rtol=rtol, what=what)
        return
    bits = [x.astype(jnp.bfloat16).view(np.int16).astype(np.int32) for x in (got, want)]
    near = np.abs(got - want) <= rtol * np.linalg.norm(want)  # across zero
    assert np.all((np.abs(bits[0] - bits[1]) <= 1) | near), what
    assert np.mean(got != want) <= 0.01, (what, np.mean(got != want))


def _compare(dp, ref, dtypes, rtol, steps=3):
    """``steps`` engine steps against the reference, each from the engine's own state (the
    reference restarted from its params and its moments): a rounding flip in one step is not
    carried into the next as an error of the engine."""
    params = mlp_params()
    state, ref_state = dp.init(params), ref.init(params)
    _check_stored(dp, state, dtypes)
    for s in range(steps):
        ref_state = ref.restart(ref_state, dp, state)
        opt = jax.tree.leaves(jax.device_get(dp.plan.strategy.to_canonical(state)[2]))
        opt = [x.astype(np.float32) if x.dtype == jnp.bfloat16 else x for x in opt]
        ref_state = ref_state._replace(
            opt_state=jax.tree.unflatten(jax.tree.structure(ref_state.opt_state), opt)
        )
        batch = make_batch(48, seed=s)
        state, _ = dp.step(state, dp.shard_batch(batch))
        ref_state, _ = ref.step(ref_state, batch)
        _check_stored(dp, state, dtypes)
        got, want = _canonical_moments(dp, state), _moments(ref_state.opt_state)
        assert [r for r, _ in got] == [r for r, _ in want]
        for i, ((role, g), (_, w)) in enumerate(zip(got, want, strict=True)):
            _assert_rounded_alike(g, w, dtypes.get(role, F32), rtol, f"step {s}: {role} #{i}")
        assert_trees_close(dp.params(state), ref.params(ref_state), rtol=rtol, what="params")


CASES = [
    # (stage, dp, exp_avg_dtype, exp_avg_sq_dtype, extra config)
    (0, 6, BF16, BF16, {}),
    (1, 6, BF16, BF16, {}),
    (2, 3, BF16, BF16, {"num_microbatches": 2}),
    (3, 6, BF16, BF16, {}),
    (1, 3, BF16, F32, {}),
    (3, 3, F32, BF16, {}),
    (1, 6, BF16, BF16, {"bucket_layout": "megatron", "bucket_size": 200}),
]


@pytest.mark.parametrize(("stage", "ndev", "avg", "avg_sq", "extra"), CASES)
def test_moments_match_a_rounding_reference(stage, ndev, avg, avg_sq, extra):
    cfg = dict(zero_stage=stage, exp_avg_dtype=avg, exp_avg_sq_dtype=avg_sq, **extra)
    dtypes = {r: d for r, d in (("exp_avg", avg), ("exp_avg_sq", avg_sq)) if d != F32}
    dp = _engine(ndev, OPTIMIZERS["adamw"](), **cfg)
    ref = Reference(mse_loss, rounding(OPTIMIZERS["adamw"](), dtypes), DDPConfig(**extra), dp=ndev)
    _compare(dp, ref, dtypes, tolerance(jnp.float32))


def test_bf16_params_and_moments_match_at_bf16_tolerance():
    """bf16 working params: the gradients themselves differ from the reference's at bf16's
    rounding, and so do the moments computed from them (stage 2, dp = 8)."""
    extra = {"param_dtype": "bfloat16"}
    dtypes = {"exp_avg": BF16, "exp_avg_sq": BF16}
    dp = _engine(
        8,
        OPTIMIZERS["adamw"](),
        zero_stage=2,
        exp_avg_dtype=BF16,
        exp_avg_sq_dtype=BF16,
        **extra,
    )
    ref = Reference(mse_loss, rounding(OPTIMIZERS["adamw"](), dtypes), DDPConfig(**extra), dp=8)
    params = mlp_params()
    state, ref_state = dp.init(params), ref.init(params)
    for s in range(3):
        batch = make_batch(48, seed=s)
        state, _ = dp.step(state, dp.shard_batch(batch))
        ref_state, _ = ref.step(ref_state, batch)
    _check_stored(dp, state, dtypes)
    rtol = tolerance(jnp.bfloat16)
    got, want = _canonical_moments(dp, state), _moments(ref_state.opt_state)
    for i, ((role, g), (_, w)) in enumerate(zip(got, want, strict=True)):
        assert_trees_close(g.astype(jnp.float32), w, rtol=rtol, what=f"{role} #{i}")
    assert_trees_close(dp.params(state), ref.params(ref_state), rtol=rtol, what="params")


@pytest.mark.parametrize("name", ["lamb", "amsgrad", "adabelief", "lion"])
def test_adam_family_moments_match_a_rounding_reference(name):
    dtypes = {"exp_avg": BF16} if name == "lion" else {"exp_avg": BF16, "exp_avg_sq": BF16}
    fields = {f"{role}_dtype": d for role, d in dtypes.items()}
    dp = _engine(3, OPTIMIZERS[name](), zero_stage=2, **fields)
    ref = Reference(mse_loss, rounding(OPTIMIZERS[name](), dtypes), DDPConfig(), dp=3)
    _compare(dp, ref, dtypes, tolerance(jnp.float32))


def test_moments_are_narrowed_only_when_asked():
    """The default keeps optax's own state: the same dtypes and no extra casts."""
    dp = _engine(2, optax.adam(1e-2, mu_dtype=jnp.bfloat16), zero_stage=1)
    dtypes = {(role, x.dtype) for role, x in _moments(dp.init(mlp_params()).opt_state)}
    assert dtypes == {("exp_avg", jnp.dtype(BF16)), ("exp_avg_sq", jnp.dtype(F32))}


@pytest.mark.parametrize(
    ("opt", "field", "state"),
    [
        (lambda: optax.sgd(0.1, momentum=0.9), "exp_avg_dtype", "TraceState"),
        (lambda: optax.rmsprop(1e-3), "exp_avg_sq_dtype", "ScaleByRmsState"),
        (
            lambda: optax.chain(optax.scale_by_rms(), optax.scale(-1e-3)),
            "exp_avg_dtype",
            "ScaleByRmsState",
        ),
        (lambda: optax.lion(1e-3), "exp_avg_sq_dtype", "ScaleByLionState"),
    ],
)
def test_an_optimizer_without_adam_moments_is_refused(opt, field, state):
    dp = _engine(2, opt(), zero_stage=1, **{field: BF16})
    with pytest.raises(ValueError, match=f"DDPConfig.{field}='bfloat16'") as info:
        dp.init(mlp_params())
    msg = str(info.value)
    assert state in msg and f"{field}='float32'" in msg and "Fix:" in msg


def test_config_checks_the_fields():
    cfg = DDPConfig(exp_avg_dtype=jnp.bfloat16, exp_avg_sq_dtype="float32")
    assert (cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype) == (BF16, F32)
    assert DDPConfig.from_dict(cfg.to_dict()) == cfg
    # Megatron's names for them
    assert DDPConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="fp32").exp_avg_dtype == BF16
    with pytest.raises(ValueError, match=r"exp_avg_sq_dtype: got 'float16'.*underflow"):
        DDPConfig(exp_avg_sq_dtype="float16")
    with pytest.raises(ValueError, match=r"exp_avg_dtype: got 'fp16'.*underflow"):
        DDPConfig(exp_avg_dtype="fp16")
    with pytest.raises(ValueError, match=r"exp_avg_dtype: got 'float64'"):
        DDPConfig(exp_avg_dtype="float64")
    with pytest.raises(TypeError, match=r"exp_avg_dtype: got 2"):
        DDPConfig(exp_avg_dtype=2)


def test_train_set_knows_the_fields():
    from jaxdp.train._options import apply_set, load_run_config

    cfg = apply_set(load_run_config(None), ["exp_avg_dtype=bfloat16", "ddp.exp_avg_sq_dtype=bf16"])
    assert (cfg.ddp.exp_avg_dtype, cfg.ddp.exp_avg_sq_dtype) == (BF16, BF16)


# ------------------------------------------------------------------ checkpoints
def _stored(dp, state):
    return [(r, np.asarray(x)) for r, x in _canonical_moments(dp, state)]


@pytest.mark.parametrize(
    ("dst_ndev", "dst"),
    [
        (8, {"zero_stage": 1}),  # the same engine
        (3, {"zero_stage": 3}),
        (6, {"zero_stage": 0, "exp_avg_dtype": F32, "exp_avg_sq_dtype": F32}),  # widened
        (6, {"zero_stage": 2, "exp_avg_sq_dtype": F32}),
    ],
)
def test_checkpoint_keeps_dtype_and_values(tmp_path, dst_ndev, dst):
    moments = {"exp_avg_dtype": BF16, "exp_avg_sq_dtype": BF16}
    src = _engine(8, OPTIMIZERS["adamw"](), zero_stage=1, **moments)
    state = src.init(mlp_params())
    for s in range(2):
        state, _ = src.step(state, src.shard_batch(make_batch(48, seed=s)))
    with CheckpointManager(tmp_path, src) as ckpt:
        ckpt.save(2, state)
        ckpt.wait_until_finished()
    saved, cfg = _stored(src, state), moments | dst
    eng = _engine(dst_ndev, OPTIMIZERS["adamw"](), **cfg)
    jax.eval_shape(eng.init, mlp_params())
    with CheckpointManager(tmp_path, eng) as ckpt:
        restored = ckpt.restore()
    want = {"exp_avg": cfg["exp_avg_dtype"], "exp_avg_sq": cfg["exp_avg_sq_dtype"]}
    _check_stored(eng, restored, {r: d for r, d in want.items() if d != F32})
    for (role, a), (_, b) in zip(saved, _stored(eng, restored), strict=True):
        assert b.dtype == jnp.dtype(want[role])
        np.testing.assert_array_equal(a.astype(np.float32), b.astype(np.float32))  # exact
    for a, b in zip(jax.tree.leaves(src.params(state)), jax.tree.leaves(eng.params(restored))):
        np.testing.assert_array_equal(a, b)


def test_float32_checkpoint_restores_rounded_to_nearest(tmp_path):
    src = _engine(4, OPTIMIZERS["adamw"](), zero_stage=2)
    state = src.init(mlp_params())
    state, _ = src.step(state, src.shard_batch(make_batch(48)))
    with CheckpointManager(tmp_path, src) as ckpt:
        ckpt.save(1, state)
        ckpt.wait_until_finished()
    eng = _engine(6, OPTIMIZERS["adamw"](), zero_stage=1, exp_avg_dtype=BF16)
    jax.eval_shape(eng.init, mlp_params())
    with CheckpointManager(tmp_path, eng) as ckpt:
        restored = ckpt.restore()
    for (role, a), (_, b) in zip(_stored(src, state), _stored(eng, restored), strict=True):
        assert a.dtype == np.float32
        assert b.dtype == (jnp.bfloat16 if role == "exp_avg" else np.float32)
        np.testing.assert_array_equal(a.astype(b.dtype), b)


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_state_is_4_bytes_per_param_over_dp(h100, stage):
    """Per device on 8 compile-only H100s (the state's shardings; nothing compiles): at most
    1.02 x 4 B x params / dp with both moments in bfloat16, and twice that in float32."""
    from jaxdp.aot import abstract_state, example_mlp

    loss_fn, params, batch = example_mlp(8, 256, batch=64)
    psi = sum(x.size for x in jax.tree.leaves(params))

    def per_device(**moments):
        cfg = DDPConfig(zero_stage=stage, param_dtype="bfloat16", **moments)
        dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=h100)
        opt = abstract_state(dp, params, batch).opt_state
        return sum(
            math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(opt)
        )

    narrow = per_device(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    assert narrow <= 1.02 * 4 * psi / 8, narrow / (4 * psi / 8)
    assert per_device() == pytest.approx(2 * narrow, rel=1e-3)


# ------------------------------------------------------------------ loss
def test_bf16_moments_train_like_fp32_moments():
    """A 150-step run with bfloat16 moments ends within 2% of the float32-moment run's loss
    (an MLP learning a teacher MLP; the 1,000-step GPT runs are bench/bench_moments.py,
    BENCHMARKS.md section 14)."""
    teacher, rng = mlp_params(seed=7), np.random.default_rng(0)
    xs = rng.standard_normal((150, 48, 6)).astype(np.float32)
    batches = [{"x": x, "y": mlp_apply(teacher, jnp.asarray(x))} for x in xs]

    def final_loss(**moments):
        dp = _engine(3, optax.adamw(3e-3, b2=0.95), zero_stage=1, **moments)
        state, losses = dp.init(mlp_params()), []
        for b in batches:
            state, m = dp.step(state, dp.shard_batch(b))
            losses.append(m["loss"])
        first, last = (float(np.mean(jax.device_get(x))) for x in (losses[:10], losses[-10:]))
        return first, last

    (first, fp32), (_, bf16) = final_loss(), final_loss(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    assert fp32 < first / 4  # it learned
    assert abs(bf16 / fp32 - 1) < 0.02, (fp32, bf16)
