"""Every DataParallel error path: clear messages before anything compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_batch, mlp_params, mse_loss

from jaxdp import DataParallel, DDPConfig


def engine(**kw):
    return DataParallel(mse_loss, optax.sgd(0.1), DDPConfig(**kw))


def test_constructor_errors():
    with pytest.raises(TypeError, match="loss_fn is a int; expected a callable"):
        DataParallel(3, optax.sgd(0.1), DDPConfig())
    with pytest.raises(TypeError, match=r"expected an optax\.GradientTransformation"):
        DataParallel(mse_loss, "adam", DDPConfig())
    with pytest.raises(TypeError, match=r"expected a jaxdp\.DDPConfig"):
        DataParallel(mse_loss, optax.sgd(0.1), {"zero_stage": 1})
    DataParallel(mse_loss, optax.sgd(0.1), DDPConfig(zero_stage=3))  # implemented
    with pytest.raises(ValueError, match=r"gradient_accumulation_fusion.*zero_stage <= 2"):
        DataParallel(
            mse_loss,
            optax.sgd(0.1),
            DDPConfig(zero_stage=3, gradient_accumulation_fusion=True),
        )
    with pytest.raises(ValueError, match="expected one named 'batch'"):
        DataParallel(
            mse_loss,
            optax.sgd(0.1),
            DDPConfig(data_axis="batch"),
            mesh=jax.make_mesh((8,), ("data",)),
        )


def test_layout_before_init():
    with pytest.raises(RuntimeError, match=r"call init\(params\) first"):
        engine().layout  # noqa: B018
    with pytest.raises(RuntimeError, match=r"call init\(params\) first"):
        engine().step  # noqa: B018


@pytest.mark.parametrize("g", [1, 4])
def test_batch_leading_dim_not_divisible(g):
    dp = engine(num_microbatches=g)
    state = dp.init(mlp_params())
    with pytest.raises(
        ValueError,
        match=rf"leading dimension is 36; expected a positive multiple "
        rf"of num_microbatches x dp = {g} x 8 = {8 * g}",
    ):
        dp.step(state, make_batch(36))
    with pytest.raises(ValueError, match="leading dimension is 36"):
        dp.shard_batch(make_batch(36))


def test_batch_structure_dtype_and_shape_mismatch():
    dp = engine()
    state = dp.init(mlp_params())
    state, _ = dp.step(state, dp.shard_batch(make_batch(16)))
    bad = make_batch(16)
    with pytest.raises(ValueError, match="tree structure"):
        dp.step(state, {"x": bad["x"]})
    with pytest.raises(
        ValueError,
        match=r"batch leaf \['x'\] has per-example shape \(7,\) and "
        r"dtype float32; expected \(6,\) and float32",
    ):
        dp.step(state, {"x": jnp.ones((16, 7)), "y": bad["y"]})
    with pytest.raises(ValueError, match=r"dtype float16; expected \(6,\) and float32"):
        # cast by numpy: XLA:CPU cannot round to float16 on x86 without F16C (test_layout.py)
        dp.step(state, {"x": np.asarray(bad["x"]).astype(np.float16), "y": bad["y"]})
    with pytest.raises(ValueError, match="share one leading"):
        dp.step(state, {"x": bad["x"], "y": bad["y"][:8]})
    with pytest.raises(ValueError, match="no array leaves"):
        dp.step(state, {})


def test_loss_fn_return_errors():
    params = mlp_params()
    dp = DataParallel(lambda p, b: (1.0, 2.0, 3.0), optax.sgd(0.1), DDPConfig())
    state = dp.init(params)
    with pytest.raises(ValueError, match="loss or \\(loss, aux\\); got a tuple of 3"):
        dp.step(state, dp.shard_batch(make_batch(16)))
    dp = DataParallel(mse_loss, optax.sgd(0.1), DDPConfig(calculate_per_token_loss=True))
    state = dp.init(params)
    with pytest.raises(ValueError, match=r"must return \(loss_sum, num_tokens\)"):
        dp.step(state, dp.shard_batch(make_batch(16)))


def test_init_with_different_params_is_rejected():
    dp = engine()
    dp.init(mlp_params())
    with pytest.raises(ValueError, match="different structure, shapes or dtypes"):
        dp.init(mlp_params(sizes=(6, 8, 4)))


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("donate", [True, False])
def test_nan_names_the_parameter_and_keeps_the_last_good_state(stage, donate):
    params = mlp_params()

    def loss_fn(p, b):
        # A NaN that reaches only layer1's bias gradient, on the ranks whose batch has x[0,0] > 50
        poison = jnp.where(b["x"][0, 0] > 50.0, jnp.nan, 0.0)
        return mse_loss(p, b) + poison * jnp.sum(p["layer1"]["b"])

    cfg = DDPConfig(zero_stage=stage, check_for_nan_in_grad=True, num_microbatches=2)
    dp = DataParallel(loss_fn, optax.adam(1e-2), cfg, donate=donate)
    state = dp.init(params)
    good = make_batch(32)
    state, _ = dp.step(state, dp.shard_batch(good))
    before = jax.tree.map(np.asarray, dp.params(state))
    bad = dict(good, x=good["x"].at[4, 0].set(100.0))  # rank 1, micro-batch 0
    with pytest.raises(FloatingPointError) as info:
        dp.step(state, dp.shard_batch(bad))
    err = info.value
    msg = str(err)
    assert "['layer1/b']" in msg and "at step 1" in msg and "on 1 of 8 ranks" in msg
    assert err.paths == ["layer1/b"]
    last_good = err.state if donate else state
    assert int(last_good.step) == 1
    after = dp.params(last_good)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    # Training goes on from the last good state.
    resumed, m = dp.step(last_good, dp.shard_batch(good))
    assert int(resumed.step) == 2 and np.isfinite(float(m["loss"]))


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_donated_state_passed_again_is_named(stage):
    # jax 0.10 segfaults (exit 139) when a donating jit gets deleted buffers on several devices.
    dp = engine(zero_stage=stage)
    state = dp.init(mlp_params())
    batch = dp.shard_batch(make_batch(16))
    new, _ = dp.step(state, batch)
    with pytest.raises(
        ValueError,
        match=r"DataParallel\.step: state was donated to an earlier step \(its buffers are "
        r"deleted: state\.step\.is_deleted\(\) is True\); a donated state cannot be passed "
        r"again\. Fix: use the state returned by that step .*jax\.tree\.map\(jnp\.copy, "
        r"state\).*DataParallel\(\.\.\., donate=False\)",
    ):
        dp.step(state, batch)
    new, _ = dp.step(new, batch)  # the returned state goes on
    assert int(new.step) == 2


def test_a_copy_or_donate_false_keeps_the_input_state_usable():
    batch = make_batch(16)
    dp = engine()
    state = dp.init(mlp_params())
    keep = jax.tree.map(jnp.copy, state)
    a, _ = dp.step(state, dp.shard_batch(batch))
    b, _ = dp.step(keep, dp.shard_batch(batch))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    dp = DataParallel(mse_loss, optax.sgd(0.1), DDPConfig(), donate=False)
    state = dp.init(mlp_params())
    dp.step(state, dp.shard_batch(batch))
    again, _ = dp.step(state, dp.shard_batch(batch))
    assert int(again.step) == 1


def per_example_loss(p, b):
    from _models import mlp_apply

    return jnp.mean((mlp_apply(p, b["x"]) - b["y"]) ** 2, axis=-1)  # shape (micro-batch,)


SCALAR_FIX = r"Fix: return the mean over the micro-batch, e.g\. jnp\.mean\(per_example_loss\)\."
LOSS_OUTPUTS = [  # (loss_fn, config, exception, message)
    (
        per_example_loss,
        {},
        ValueError,
        r"DataParallel: loss_fn returned a loss of shape \(2,\) and dtype float32 for one "
        r"micro-batch of 2 examples \(on each device\); expected a scalar\. " + SCALAR_FIX,
    ),
    (
        lambda p, b: (per_example_loss(p, b), {"n": jnp.ones(())}),
        {},
        ValueError,
        r"loss_fn returned a loss \(the first of \(loss, aux\)\) of shape \(2,\) and dtype "
        r"float32 for one micro-batch of 2 examples \(on each device\); expected a scalar\. "
        + SCALAR_FIX,
    ),
    (
        lambda p, b: per_example_loss(p, b),
        {"num_microbatches": 2},
        ValueError,
        r"a loss of shape \(1,\) and dtype float32 for one micro-batch of 1 examples",
    ),
    (
        lambda p, b: jnp.sum(b["x"] > 0),
        {},
        ValueError,
        r"loss_fn returned a loss of shape \(\) and dtype int32 for one micro-batch of 2 "
        r"examples \(on each device\); expected a floating-point scalar \(gradients need a real "
        r"float output\)\. " + SCALAR_FIX[:-2] + r", in floating point \(e\.g\. "
        r"\.astype\(jnp\.float32\)\)\.",
    ),
    (
        lambda p, b: "loss",
        {},
        TypeError,
        r"loss_fn returned a str as its loss for one micro-batch; expected a scalar array",
    ),
    (
        lambda p, b: (per_example_loss(p, b) * 2, jnp.full((2,), 3.0)),
        {"calculate_per_token_loss": True},
        ValueError,
        r"loss_fn returned a loss_sum of shape \(2,\) and dtype float32 for one micro-batch of 2 "
        r"examples \(on each device\); expected a scalar\. Fix: return \(loss_sum, num_tokens\) "
        r"for the micro-batch, both scalars",
    ),
    (
        lambda p, b: (mse_loss(p, b) * 2, jnp.ones((2,), jnp.int32)),
        {"calculate_per_token_loss": True},
        ValueError,
        r"a num_tokens of shape \(2,\) and dtype int32 for one micro-batch of 2 examples",
    ),
]


@pytest.mark.parametrize(("loss_fn", "cfg", "exc", "msg"), LOSS_OUTPUTS)
@pytest.mark.parametrize("stage", [0, 3])
def test_loss_fn_must_return_a_float_scalar(loss_fn, cfg, exc, msg, stage):
    dp = DataParallel(loss_fn, optax.sgd(0.1), DDPConfig(zero_stage=stage, **cfg))
    state = dp.init(mlp_params())
    batch = dp.shard_batch(make_batch(16))
    with pytest.raises(exc, match=msg):
        dp.step(state, batch)
    with pytest.raises(exc, match=msg):  # also before an AOT compile
        dp.step.lower(state, batch)
    assert not state.step.is_deleted()  # raised while tracing: nothing ran, nothing donated


def test_per_token_loss_with_an_int_token_count_is_accepted():
    def loss_fn(p, b):
        return mse_loss(p, b) * b["x"].shape[0], jnp.asarray(b["x"].shape[0], jnp.int32)

    dp = DataParallel(loss_fn, optax.sgd(0.1), DDPConfig(calculate_per_token_loss=True))
    state = dp.init(mlp_params())
    state, m = dp.step(state, dp.shard_batch(make_batch(16)))
    assert float(m["num_tokens"]) == 16.0
