"""The GPT's token embedding: ``nn.Embed``'s parameter and values, a gradient summed in fp32
without a scatter of the working dtype (see ``jaxdp.models.gpt._Embed``)."""

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.models import GPT, GPTConfig, next_byte_loss
from jaxdp.models.gpt import ONE_HOT_MAX_VOCAB, _Embed
from jaxdp.testing import assert_trees_close, tolerance
from jaxdp.testing._bf16 import bf16_ulp

# one vocabulary on each side of the one-hot limit
VOCABS = (256, ONE_HOT_MAX_VOCAB + 7)


def _tokens(vocab, shape=(4, 33), seed=1):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_same_parameter_and_lookup_as_flax_embed(vocab, dtype):
    tokens = _tokens(vocab)
    ours, flax_embed = _Embed(vocab, 48), nn.Embed(vocab, 48)
    p = ours.init(jax.random.key(0), tokens)
    p_flax = flax_embed.init(jax.random.key(0), tokens)
    # checkpoints and initial values carry over: same name, shape, init
    assert jax.tree.structure(p) == jax.tree.structure(p_flax)
    np.testing.assert_array_equal(p["params"]["embedding"], p_flax["params"]["embedding"])
    p = jax.tree.map(lambda x: x.astype(dtype), p)
    got, want = ours.apply(p, tokens), flax_embed.apply(p, tokens)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("vocab", VOCABS)
def test_gradient_matches_the_gather_in_fp32(vocab):
    tokens = _tokens(vocab, (8, 65))
    ours, flax_embed = _Embed(vocab, 32), nn.Embed(vocab, 32)
    p = ours.init(jax.random.key(0), tokens)
    g = jax.random.normal(jax.random.key(2), (*tokens.shape, 32))

    def grad(module):
        return jax.grad(lambda q: jnp.vdot(module.apply(q, tokens), g))(p)

    assert_trees_close(grad(ours), grad(flax_embed), rtol=tolerance(jnp.float32))


@pytest.mark.parametrize("vocab", VOCABS)
def test_bf16_gradient_is_summed_in_fp32(vocab):
    """Every row of a bf16 table's gradient is its fp32 (here exact) sum rounded once to bf16:
    a bf16 running sum would stall (256 + 1 rounds back to 256) long before the 4,083
    repeats of one token here."""
    tokens = np.full((4, 1024), 7)
    tokens[0, :13] = np.arange(13)
    tokens = jnp.asarray(tokens)
    ours = _Embed(vocab, 16)
    p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), ours.init(jax.random.key(0), tokens))
    g = jax.random.normal(jax.random.key(3), (*tokens.shape, 16)).astype(jnp.bfloat16)
    got = jax.grad(lambda q: jnp.vdot(ours.apply(q, tokens).astype(jnp.float32), g))(p)
    got = np.asarray(got["params"]["embedding"], np.float64)
    want = np.zeros((vocab, 16))
    np.add.at(want, np.asarray(tokens).ravel(), np.asarray(g, np.float64).reshape(-1, 16))
    assert np.all(np.abs(got - want) <= bf16_ulp(want)), np.abs(got - want).max()
    ones = jax.grad(lambda q: ours.apply(q, tokens).astype(jnp.float32).sum())(p)
    row = np.asarray(ones["params"]["embedding"][7], np.float32)
    np.testing.assert_array_equal(row, np.full(16, 4 * 1024 - 13, np.float32).astype(jnp.bfloat16))


def _scatters(jaxpr):
    """(shape, dtype) of every scatter's result in ``jaxpr`` and the jaxprs inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("scatter"):
            aval = eqn.outvars[0].aval
            found.append((aval.shape, aval.dtype))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _scatters(sub)
    return found


@pytest.mark.parametrize("vocab", VOCABS)
def test_gpt_gradient_scatters_nothing_in_bf16(vocab):
    """The model's backward (bf16 working params) scatters nothing into the table up to the
    one-hot limit, and in fp32 above it (the loss's label pick scatters fp32 logits, no table)."""
    model = GPT(GPTConfig(layers=1, width=32, heads=2, context=16, vocab=vocab))
    params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    batch = {"tokens": _tokens(vocab, (2, 17))}
    grad = jax.grad(lambda p: next_byte_loss(model, p, batch))
    found = _scatters(jax.make_jaxpr(grad)(params).jaxpr)
    assert all(dtype == jnp.float32 for _, dtype in found), found
    into_table = [dtype for shape, dtype in found if shape == (vocab, 32)]
    assert into_table == ([] if vocab <= ONE_HOT_MAX_VOCAB else [jnp.float32]), found
