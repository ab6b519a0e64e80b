"""A model collective over an axis name the step does not bind (flax's ImageNet ResNet has
``nn.BatchNorm(axis_name="batch")``; jaxdp's data axis is ``"data"``) is named, with both axes
and the fix, instead of jax's bare AssertionError; with ``data_axis="batch"`` it trains."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdp import DataParallel, DDPConfig, LossOutput, make_mesh
from jaxdp.testing import Reference, assert_matches_reference


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, use_bias=False)(x)  # BatchNorm's bias replaces it
        x = nn.BatchNorm(use_running_average=False, axis_name="batch")(x)
        return nn.Dense(1)(nn.Dropout(0.2, deterministic=False)(nn.relu(x)))


NET = Net()
VARS = NET.init({"params": jax.random.key(0), "dropout": jax.random.key(0)}, jnp.ones((2, 4)))
INIT = {"model_state": {"batch_stats": VARS["batch_stats"]}, "rng": jax.random.key(1)}


def loss_fn(params, batch, *, model_state, rng):
    y, new = NET.apply(
        {"params": params, **model_state},
        batch["x"],
        mutable=list(model_state),
        rngs={"dropout": rng},
    )
    return LossOutput(jnp.mean((y - batch["y"]) ** 2), model_state=new)


def _batch(n=24):
    x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :1])}


@pytest.mark.parametrize("how", ["step", "lower"])
@pytest.mark.parametrize("stage", [0, 3])
def test_an_unbound_model_axis_is_named_with_the_fix(stage, how):
    mesh = make_mesh(jax.devices()[:6])
    dp = DataParallel(loss_fn, optax.sgd(0.1), DDPConfig(zero_stage=stage), mesh=mesh)
    state = dp.init(VARS["params"], **INIT)
    batch = dp.shard_batch(_batch())
    with pytest.raises(ValueError) as e:
        dp.step(state, batch) if how == "step" else dp.step.lower(state, batch)
    msg = str(e.value)
    for part in ("axis name 'batch'", "binds only 'data'", "DDPConfig(data_axis='batch')"):
        assert part in msg, msg
    assert not state.step.is_deleted()  # failed while tracing: nothing was donated


def test_stage3_init_with_an_example_batch_names_it_too():
    # init traces loss_fn to find scanned layer stacks: the same error, before the step
    dp = DataParallel(loss_fn, optax.sgd(0.1), DDPConfig(zero_stage=3))
    with pytest.raises(ValueError, match=r"DataParallel.init: .*axis name 'batch'.*only 'data'"):
        dp.init(VARS["params"], example_batch=_batch(), **INIT)


@pytest.mark.parametrize(("stage", "g", "example"), [(0, 1, False), (1, 2, False), (3, 2, True)])
def test_with_data_axis_batch_the_same_model_trains(stage, g, example):
    cfg = DDPConfig(zero_stage=stage, num_microbatches=g, data_axis="batch")
    dp = DataParallel(loss_fn, optax.sgd(0.1), cfg, mesh=make_mesh(jax.devices()[:6], axis="batch"))
    ref = Reference(loss_fn, optax.sgd(0.1), cfg, dp=dp.dp)
    # at stage 3 init also traces loss_fn (stack detection), with the BatchNorm's axis bound
    ex = {"example_batch": _batch(12 * g)} if example else {}
    state = dp.init(VARS["params"], **INIT, **ex)
    ref_state = ref.init(VARS["params"], **INIT)
    for _ in range(2):
        state, _ = dp.step(state, dp.shard_batch(_batch(12 * g)))
        ref_state, _ = ref.step(ref_state, _batch(12 * g))
    assert_matches_reference(dp, state, ref, ref_state)
