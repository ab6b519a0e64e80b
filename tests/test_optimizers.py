"""optax chains under the sharded optimizer: same result as unsharded, or a clear rejection."""

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import make_batch, max_rel_err, mlp_params, mse_loss, reference_train

from jaxdp import DataParallel, DDPConfig, make_mesh

PARAMS = mlp_params()
BATCHES = [make_batch(32, seed=s) for s in range(4)]
NOT_BIAS = jax.tree.map(lambda x: x.ndim > 1, PARAMS)  # a mask *pytree*, built from params


def schedule():
    return optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw_mask": lambda: optax.adamw(schedule(), weight_decay=0.1, mask=NOT_BIAS),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
    "masked": lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(0.1), NOT_BIAS), optax.adam(1e-2)
    ),
    "multi_transform": lambda: optax.multi_transform(
        {"w": optax.adam(1e-2), "b": optax.sgd(0.05)},
        jax.tree.map(lambda x: "w" if x.ndim > 1 else "b", PARAMS),
    ),
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1)),
    "lamb": lambda: optax.lamb(1e-2),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_matches_reference(name, stage):
    opt = OPTIMIZERS[name]()
    ref, _ = reference_train(mse_loss, opt, PARAMS, BATCHES)
    dp = DataParallel(mse_loss, opt, DDPConfig(zero_stage=stage, bucket_size=300))
    state = dp.init(PARAMS)
    for b in BATCHES:
        state, _ = dp.step(state, dp.shard_batch(b))
    assert max_rel_err(dp.params(state), ref) < 1e-6


def test_optimizer_state_keeps_params_structure():
    opt = optax.adamw(1e-2, mask=NOT_BIAS)
    dp = DataParallel(mse_loss, opt, DDPConfig(zero_stage=1))
    state = dp.init(PARAMS)
    mu = state.opt_state[0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(PARAMS)
    assert mu["layer0"]["w"].sharding.spec == jax.sharding.PartitionSpec("data")


def big_params():
    return {"w": jnp.ones((256, 130)), "b": jnp.ones((130,))}


@pytest.mark.parametrize(
    ("name", "opt", "params", "fragment"),
    [
        ("factored adafactor", lambda: optax.adafactor(1e-2), big_params, "for sharded ones"),
        ("adafactor rms clipping", lambda: optax.adafactor(1e-2), mlp_params, "updates parameter"),
        (
            "ndim mask",
            lambda: optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
            mlp_params,
            "updates parameter",
        ),
    ],
)
def test_shape_dependent_optimizers_are_rejected(name, opt, params, fragment):
    dp = DataParallel(mse_loss, opt(), DDPConfig(zero_stage=1))
    with pytest.raises(ValueError, match=fragment) as info:
        dp.init(params())
    assert "zero_stage=0" in str(info.value)  # says how to fix
    # Stage 0 keeps whole tensors: the same optimizer is accepted.
    DataParallel(mse_loss, opt(), DDPConfig(zero_stage=0)).init(params())


def test_probe_under_eval_shape_and_reinit(monkeypatch):
    """The numeric probe runs on a thread of its own (outside the caller's trace): under
    ``jax.eval_shape`` (``jaxdp.aot``, ``jaxdp-train --resume``) it still refuses, with the
    same message, and a second ``init`` with the same optimizer does not probe again."""
    bad = optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    dp = DataParallel(mse_loss, bad, DDPConfig(zero_stage=1))
    with pytest.raises(ValueError, match=r"updates parameter .*layer0"):
        jax.eval_shape(dp.init, PARAMS)

    import jaxdp._src.optim.check as optim_check

    calls = []
    probe = optim_check._numeric_check
    monkeypatch.setattr(optim_check, "_numeric_check", lambda *a: calls.append(1) or probe(*a))
    # adagrad is elementwise but not among the optimizers known without a probe
    dp = DataParallel(mse_loss, optax.adagrad(1e-2), DDPConfig(zero_stage=1))
    abstract = jax.eval_shape(dp.init, PARAMS)
    n = jax.device_count()
    assert abstract.master["layer0"]["w"].shape == (-(-6 * 16 // n) * n,)
    state = dp.init(PARAMS)  # same optimizer, same layout: checked once
    assert calls == [1]
    state, _ = dp.step(state, dp.shard_batch(BATCHES[0]))
    assert int(state.step) == 1


def test_megatron_layout_rejects_tree_masks():
    opt = optax.adamw(1e-2, mask=NOT_BIAS)
    dp = DataParallel(mse_loss, opt, DDPConfig(zero_stage=1, bucket_layout="megatron"))
    with pytest.raises(ValueError, match="bucket_layout='interleaved'"):
        dp.init(PARAMS)
    lamb = DataParallel(
        mse_loss, optax.lamb(1e-2), DDPConfig(zero_stage=1, bucket_layout="megatron")
    )
    with pytest.raises(ValueError, match="updates parameter"):
        lamb.init(PARAMS)  # per-bucket trust ratios would be wrong


def scaled_loss(params, batch):
    """``mse_loss`` with a learnable scalar temperature (shape ``()``, as CLIP's logit scale)."""
    return mse_loss(params["mlp"], batch) * jnp.exp(params["log_scale"])


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp", [3, 8])
def test_scalar_parameter_matches_reference(stage, dp):
    # A shape-() parameter's sharded view is dp elements (one value, zero-padded), and so is
    # its Adam state: the structure check must accept it, and the update must match.
    params = {"mlp": PARAMS, "log_scale": jnp.asarray(0.25)}
    opt = optax.adamw(1e-2, weight_decay=0.1)
    batches = [make_batch(24, seed=s) for s in range(4)]  # 24: a multiple of 3 and of 8
    ref, _ = reference_train(scaled_loss, opt, params, batches)
    mesh = make_mesh(jax.devices()[:dp])
    dp_ = DataParallel(scaled_loss, opt, DDPConfig(zero_stage=stage, bucket_size=300), mesh=mesh)
    state = dp_.init(params)
    assert state.master["log_scale"].shape == (dp,)
    for b in batches:
        state, _ = dp_.step(state, dp_.shard_batch(b))
    got = dp_.params(state)
    assert got["log_scale"].shape == ()
    assert max_rel_err(got, ref) < 1e-6
