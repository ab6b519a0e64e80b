"""examples/padded_lm.py: the per-token loss of padded sequences (docs/loss-contract.md).

The engine's gradient and metrics are the plain single-device ones of the true objective, the
mean loss over the real target tokens of the whole global batch, at every stage, with
micro-batches, on a dp that is not a power of two; the natural wrong port (a per-micro-batch
mean) is a different objective, and the example learns."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdp import DataParallel, DDPConfig, LossOutput, make_mesh
from jaxdp.testing import assert_trees_close, reduced_gradient, tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = tolerance(jnp.float32)


def _example():
    spec = importlib.util.spec_from_file_location(
        "padded_lm", os.path.join(ROOT, "examples", "padded_lm.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # flax linen modules are dataclasses: they look themselves up
    spec.loader.exec_module(mod)
    return mod


LM = _example()
MODEL = LM.TinyLM(dropout=0.0)  # the reference has no engine keys: compare without dropout
PARAMS = MODEL.init(jax.random.key(0), jnp.zeros((1, LM.SEQ), jnp.int32), train=False)["params"]


def _engine(stage, g, loss_fn=None, per_token=True):
    cfg = DDPConfig(
        zero_stage=stage, num_microbatches=g, calculate_per_token_loss=per_token, bucket_size=300
    )
    mesh = make_mesh(jax.devices()[:6])
    eng = DataParallel(loss_fn or LM.make_loss_fn(MODEL), optax.sgd(0.5), cfg, mesh=mesh)
    return eng, eng.init(PARAMS, rng=jax.random.key(1))


@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_per_token_step_is_the_global_token_mean(stage, g):
    batch = LM.sequences(6 * g * 4, seed=3)  # 3 to 12 tokens each, so micro-batches differ
    want_loss, want_grad = jax.jit(
        jax.value_and_grad(lambda p: LM.reference_loss(MODEL, p, batch))
    )(PARAMS)
    eng, state = _engine(stage, g)
    assert_trees_close(reduced_gradient(eng, state, batch), want_grad, rtol=RTOL, what="grads")
    state, metrics = eng.step(state, eng.shard_batch(batch))
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=RTOL)
    assert float(metrics["num_tokens"]) == batch["mask"][:, 1:].sum()
    want_params = jax.tree.map(lambda p, d: p - 0.5 * d, PARAMS, want_grad)
    assert_trees_close(eng.params(state), want_params, rtol=RTOL, what="params")


def test_a_per_micro_batch_mean_is_another_objective():
    """``loss_sum / num_tokens`` returned as a mean (the natural port) weighs each micro-batch
    and rank equally: its gradient is the mean of the micro-batches' per-token means, not the
    global per-token mean, and the two differ by far more than rounding."""

    def mean_loss(params, batch, *, rng):
        out = LM.make_loss_fn(MODEL)(params, batch, rng=rng)
        return LossOutput(out.loss / out.num_tokens, aux=out.aux)

    g, batch = 2, LM.sequences(6 * 2 * 4, seed=3)
    eng, state = _engine(1, g, mean_loss, per_token=False)
    got = reduced_gradient(eng, state, batch)
    pieces = [jax.tree.map(lambda x, i=i: x[i * 4 : (i + 1) * 4], batch) for i in range(6 * g)]

    def mean_of_means(p):
        return sum(LM.reference_loss(MODEL, p, b) for b in pieces) / len(pieces)

    assert_trees_close(got, jax.jit(jax.grad(mean_of_means))(PARAMS), rtol=RTOL, what="grads")
    true = jax.jit(jax.grad(lambda p: LM.reference_loss(MODEL, p, batch)))(PARAMS)
    err = optax.tree.norm(jax.tree.map(jnp.subtract, got, true)) / optax.tree.norm(true)
    assert err > 1e3 * RTOL, err


def test_padded_lm_example_learns(capsys):
    out = LM.main(["--steps", "30", "--devices", "6", "--stage", "3"])
    assert "padded LM on 6 devices" in capsys.readouterr().out
    assert out["losses"][-1] < 0.5 * out["losses"][0], out["losses"]
    assert out["eval_accuracy"] > 0.6, out  # chance: 1/15
