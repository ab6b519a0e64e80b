"""A tiny GPT built from jaxdp.nn layers (nn.scan over blocks), for the fusion parity tests."""

from __future__ import annotations

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np

from jaxdp import nn

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 32, 8, 16, 2, 2


class Block(linen.Module):
    dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, x, _):
        h = linen.LayerNorm(dtype=self.dtype, name="ln1")(x)
        qkv = nn.DenseGeneral((3, HEADS, WIDTH // HEADS), dtype=self.dtype, name="qkv")(h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(WIDTH // HEADS).astype(self.dtype)
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        att = jax.nn.softmax(jnp.where(mask, att, -1e9).astype(jnp.float32)).astype(self.dtype)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v)
        o = nn.DenseGeneral(WIDTH, axis=(-2, -1), dtype=self.dtype, name="proj")(o)
        x = x + o
        h = linen.LayerNorm(dtype=self.dtype, name="ln2")(x)
        h = nn.Dense(4 * WIDTH, dtype=self.dtype, name="fc")(h)
        x = x + nn.Dense(WIDTH, dtype=self.dtype, name="out")(jax.nn.gelu(h))
        return x, None


class GPT(linen.Module):
    dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, tokens):
        x = linen.Embed(VOCAB, WIDTH, dtype=self.dtype, name="wte")(tokens)
        pos = self.param("wpe", linen.initializers.normal(0.02), (SEQ, WIDTH))
        x = x + pos.astype(self.dtype)
        blocks = linen.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=LAYERS,
        )
        x, _ = blocks(self.dtype, name="blocks")(x, None)
        x = linen.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return nn.Dense(VOCAB, dtype=self.dtype, name="head")(x)


def gpt_params(seed: int = 0):
    return GPT().init(jax.random.key(seed), jnp.zeros((1, SEQ), jnp.int32))["params"]


def gpt_loss(dtype):
    model = GPT(dtype)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)
        return jnp.mean(nll)

    return loss_fn


def token_batches(n: int, steps: int, vocab: int, seq: int, seed: int = 1):
    """``steps`` batches of ``n`` token sequences (``tokens``, ``targets`` of length ``seq``)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        t = rng.integers(0, vocab, size=(n, seq + 1)).astype(np.int32)
        # A learnable pattern: the next token is (token + 1) % vocab half of the time.
        t[:, 1:] = np.where(rng.random((n, seq)) < 0.5, (t[:, :-1] + 1) % vocab, t[:, 1:])
        out.append({"tokens": jnp.asarray(t[:, :-1]), "targets": jnp.asarray(t[:, 1:])})
    return out


def gpt_batches(n: int, steps: int, seed: int = 1):
    return token_batches(n, steps, VOCAB, SEQ, seed)
