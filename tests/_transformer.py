"""A tiny unrolled flax linen transformer (plain linen layers, 4 blocks) for the ZeRO-3 tests."""

from __future__ import annotations

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
from _gpt_nn import token_batches

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 16, 8, 16, 2, 4


class Block(linen.Module):
    dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, x):
        h = linen.LayerNorm(dtype=self.dtype, param_dtype=self.dtype, name="ln1")(x)
        qkv = linen.DenseGeneral(
            (3, HEADS, WIDTH // HEADS), dtype=self.dtype, param_dtype=self.dtype, name="qkv"
        )(h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(WIDTH // HEADS)
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        att = jax.nn.softmax(jnp.where(mask, att, -1e9)).astype(self.dtype)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v)
        o = linen.DenseGeneral(
            WIDTH, axis=(-2, -1), dtype=self.dtype, param_dtype=self.dtype, name="proj"
        )(o)
        x = x + o
        h = linen.LayerNorm(dtype=self.dtype, param_dtype=self.dtype, name="ln2")(x)
        h = linen.Dense(2 * WIDTH, dtype=self.dtype, param_dtype=self.dtype, name="fc")(h)
        return x + linen.Dense(WIDTH, dtype=self.dtype, param_dtype=self.dtype, name="out")(
            jax.nn.gelu(h)
        )


class Transformer(linen.Module):
    dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, tokens):
        x = linen.Embed(VOCAB, WIDTH, dtype=self.dtype, param_dtype=self.dtype, name="wte")(tokens)
        for i in range(LAYERS):  # unrolled: one set of params per block
            x = Block(self.dtype, name=f"block{i}")(x)
        x = linen.LayerNorm(dtype=self.dtype, param_dtype=self.dtype, name="ln_f")(x)
        return linen.Dense(VOCAB, dtype=self.dtype, param_dtype=self.dtype, name="head")(x)


def transformer_params(seed: int = 0):
    return Transformer().init(jax.random.key(seed), jnp.zeros((1, SEQ), jnp.int32))["params"]


def transformer_loss(params, batch):
    """Mean next-token NLL; computes in the params' dtype (bf16 params -> bf16 activations)."""
    dtype = jax.tree.leaves(params)[0].dtype
    logits = Transformer(dtype).apply({"params": params}, batch["tokens"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))


def transformer_batches(n: int, steps: int, seed: int = 1):
    return token_batches(n, steps, VOCAB, SEQ, seed)


class _ScanBlock(linen.Module):
    dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, x, _):
        return Block(self.dtype, name="block")(x), None


class ScanTransformer(linen.Module):
    """The same model with its blocks stacked by ``nn.scan`` (params ``[LAYERS, ...]`` at
    ``param_axis``)."""

    dtype: jnp.dtype = jnp.float32
    param_axis: int = 0

    @linen.compact
    def __call__(self, tokens):
        x = linen.Embed(VOCAB, WIDTH, dtype=self.dtype, param_dtype=self.dtype, name="wte")(tokens)
        stack = linen.scan(
            _ScanBlock,
            variable_axes={"params": self.param_axis},
            split_rngs={"params": True},
            length=LAYERS,
        )
        x, _ = stack(self.dtype, name="blocks")(x, None)
        x = linen.LayerNorm(dtype=self.dtype, param_dtype=self.dtype, name="ln_f")(x)
        return linen.Dense(VOCAB, dtype=self.dtype, param_dtype=self.dtype, name="head")(x)


def scan_transformer_params(seed: int = 0, param_axis: int = 0):
    """The unrolled model's params (same seed), stacked: the two models compute the same."""
    p = transformer_params(seed)
    blocks = [p[f"block{i}"] for i in range(LAYERS)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs, axis=param_axis), *blocks)
    rest = {k: v for k, v in p.items() if not k.startswith("block")}
    return {**rest, "blocks": {"block": stacked}}


def make_scan_transformer_loss(param_axis: int = 0):
    def loss(params, batch):
        dtype = jax.tree.leaves(params)[0].dtype
        model = ScanTransformer(dtype, param_axis)
        logits = model.apply({"params": params}, batch["tokens"]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))

    return loss


scan_transformer_loss = make_scan_transformer_loss(0)
