"""A byte-level GPT (decoder-only transformer) in plain flax linen.

Pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP, learned position
embeddings, an untied output head over the 256 byte values. Small enough to train on CPU
devices in minutes; the main job (``python -m jaxdp.train``) trains it with ``DataParallel``.
Its dense layers are :mod:`jaxdp.nn`'s drop-ins for flax's (flax's own computation unless
``DDPConfig(gradient_accumulation_fusion=True)``, which then computes their weight gradients
in fp32 straight from the GEMM).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen.linear import default_embed_init

from .. import nn as jnn

__all__ = [
    "ATTENTION",
    "GPT",
    "GPTConfig",
    "attention_implementation",
    "generate",
    "next_byte_loss",
]

#: ``GPTConfig.attention`` choices.
ATTENTION = ("auto", "cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model.

    Attributes:
        layers: transformer blocks.
        width: model (residual stream) width; a multiple of ``heads``.
        heads: attention heads.
        context: longest sequence, in bytes.
        vocab: vocabulary size (256 for bytes). Up to ``ONE_HOT_MAX_VOCAB`` (1,024) tokens are
            embedded as a one-hot GEMM, so the table's gradient sums in fp32 with no scatter.
        dropout: residual dropout rate (after the embedding, each attention and each MLP) in
            training (``next_byte_loss(..., rng=key)``); 0 (default) turns it off.
        scan: run the blocks as one ``nn.scan`` over params stacked ``[layers, ...]``
            (``params["blocks"]``): the block is traced and compiled once, whatever the depth,
            and ZeRO-3 gathers one layer per scan iteration.
        attention: ``jax.nn.dot_product_attention``'s implementation: ``"auto"`` (default)
            takes cuDNN's fused (flash) attention where the default backend is a GPU and the
            inputs are bf16 or fp16 with a head dimension cuDNN takes (a multiple of 8, at most
            128), XLA's elsewhere; ``"cudnn"`` or ``"xla"`` force one. (jax's own default is
            XLA's, which materialises every ``T x T`` score matrix: on a GPU it made the
            303M-parameter GPT's step much slower and far larger; BENCHMARKS.md section 13.)

    Example:
        >>> GPTConfig(layers=2, width=64, heads=2, context=32).width // 2
        32
    """

    layers: int = 4
    width: int = 128
    heads: int = 4
    context: int = 128
    vocab: int = 256
    dropout: float = 0.0
    scan: bool = False
    attention: str = "auto"

    def __post_init__(self) -> None:
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1:
            raise ValueError(
                f"GPTConfig: dropout={d!r}; expected a float in [0, 1). Fix: e.g. dropout=0.1, "
                "or 0 for none."
            )
        if not isinstance(self.scan, bool):
            raise ValueError(f"GPTConfig: scan={self.scan!r}; expected True or False.")
        if self.attention not in ATTENTION:
            raise ValueError(
                f"GPTConfig: attention={self.attention!r}; expected one of {ATTENTION}. Fix: "
                "attention='auto' (cuDNN's flash attention on GPUs, XLA's elsewhere)."
            )
        for f in dataclasses.fields(self):
            if f.name in ("dropout", "scan", "attention"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(
                    f"GPTConfig: {f.name}={v!r}; expected a positive int. Fix: e.g. "
                    f"{f.name}={f.default}."
                )
        if self.width % self.heads:
            raise ValueError(
                f"GPTConfig: width={self.width} is not a multiple of heads={self.heads}. Fix: "
                f"width={self.width // self.heads * self.heads or self.heads} or a heads value "
                f"that divides {self.width}."
            )


def attention_implementation(choice: str, dtype: Any, head_dim: int) -> Literal["cudnn", "xla"]:
    """The ``implementation`` of ``jax.nn.dot_product_attention`` that ``GPTConfig.attention``
    = ``choice`` means for inputs of ``dtype`` and heads of ``head_dim`` (see
    :class:`GPTConfig`). jax's own ``None`` means XLA's, not the best available.

    Example:
        >>> attention_implementation("auto", jnp.float32, 64)  # fp32 (or no GPU): XLA's
        'xla'
        >>> attention_implementation("cudnn", jnp.bfloat16, 64)
        'cudnn'
    """
    if choice not in ATTENTION:
        raise ValueError(
            f"attention_implementation: choice={choice!r}; expected one of {ATTENTION}. Fix: "
            "choice='auto'."
        )
    if choice != "auto":
        return "cudnn" if choice == "cudnn" else "xla"
    on_gpu = jax.default_backend() == "gpu"
    fits = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if on_gpu and fits else "xla"


class _Attention(nn.Module):
    """Causal self-attention through ``jax.nn.dot_product_attention``, cuDNN's fused (flash)
    attention or XLA's as :func:`attention_implementation` picks."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        qkv = jnn.DenseGeneral((3, cfg.heads, cfg.width // cfg.heads), name="qkv")(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [batch, time, heads, head dim]
        impl = attention_implementation(cfg.attention, q.dtype, q.shape[-1])
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        return jnn.DenseGeneral(cfg.width, axis=(-2, -1), name="out")(y)


#: Vocabularies up to this size are embedded as a one-hot matrix product (see :class:`_Embed`).
ONE_HOT_MAX_VOCAB = 1024


class _Embed(nn.Module):
    """Token embedding with ``nn.Embed``'s parameter (``embedding``, same init) whose gradient
    is summed in fp32 without a scatter of the working dtype.

    ``nn.Embed`` gathers rows; the gradient is then a scatter-add into the table in the table's
    dtype. On a GPU that is an atomic add per token and feature, and text repeats bytes, so
    the adds into the few common rows serialise: in the main job (303M GPT, 16 sequences of
    1024 bytes of Python source per pass) it took a large share of the step's kernel time on
    a GPU, far more than with uniform random tokens (BENCHMARKS.md section 13), and it rounded
    the running sum to bf16 at every token. Up to :data:`ONE_HOT_MAX_VOCAB` rows the lookup is
    ``one_hot(tokens) @ table`` instead: the forward is exact (one nonzero term), the gradient
    is a GEMM accumulating in fp32 with no atomics, and it costs ``4 x vocab x width`` FLOPs a
    token (0.05% of the 303M GPT's). Larger tables are gathered from an fp32 copy, so the
    scatter adds in fp32.
    """

    vocab: int
    width: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.param("embedding", default_embed_init, (self.vocab, self.width))
        if self.vocab > ONE_HOT_MAX_VOCAB:
            return jnp.take(table.astype(jnp.float32), tokens, axis=0).astype(table.dtype)
        # fp32 tables: the highest precision keeps GPUs from rounding them to TF32
        exact = jax.lax.Precision.HIGHEST if table.dtype == jnp.float32 else None
        onehot = jax.nn.one_hot(tokens, self.vocab, dtype=table.dtype)
        return jnp.einsum("btv,vd->btd", onehot, table, precision=exact)


class _Block(nn.Module):
    cfg: GPTConfig
    train: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        drop = nn.Dropout(cfg.dropout, deterministic=not self.train or cfg.dropout == 0)
        h = _Attention(cfg, name="attn")(nn.LayerNorm(name="ln_attn")(x))
        x = x + drop(h)
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = jnn.Dense(4 * cfg.width, name="fc")(h)
        h = jnn.Dense(cfg.width, name="proj")(nn.gelu(h))
        return x + drop(h)


class _ScanBlock(_Block):
    """``_Block`` with ``nn.scan``'s ``(carry, out)`` signature."""

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:  # type: ignore[override]
        return _Block.__call__(self, x), None


class GPT(nn.Module):
    """``GPT(cfg)(tokens[int32, (batch, time)]) -> logits[(batch, time, vocab)]``.

    ``train=True`` turns on ``cfg.dropout`` (needs a ``"dropout"`` PRNG stream).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> model = GPT(GPTConfig(layers=1, width=16, heads=2, context=8))
        >>> params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> model.apply({"params": params}, jnp.zeros((2, 8), jnp.int32)).shape
        (2, 8, 256)
    """

    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        cfg = self.cfg
        t = tokens.shape[1]
        x = _Embed(cfg.vocab, cfg.width, name="embed")(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (cfg.context, cfg.width))
        x = x + pos[:t].astype(x.dtype)
        x = nn.Dropout(cfg.dropout, deterministic=not train or cfg.dropout == 0)(x)
        if cfg.scan:  # one block traced once, its params stacked [layers, ...]
            stack = nn.scan(
                _ScanBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=cfg.layers,
            )
            x, _ = stack(cfg, train, name="blocks")(x, None)
        else:
            for i in range(cfg.layers):
                x = _Block(cfg, train, name=f"block_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        # A small head init starts the loss at ln(256), the uniform guess.
        return jnn.Dense(cfg.vocab, kernel_init=nn.initializers.normal(0.02), name="head")(x)


def next_byte_loss(
    model: GPT, params: Any, batch: dict[str, jax.Array], rng: jax.Array | None = None
) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of ``batch["tokens"]`` (``(batch, context + 1)``).

    With ``rng`` the model runs in training mode (``cfg.dropout`` drawn from ``rng``); without
    it, deterministically (evaluation).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> model = GPT(GPTConfig(layers=1, width=16, heads=2, context=8))
        >>> p = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> loss = next_byte_loss(model, p, {"tokens": jnp.zeros((2, 9), jnp.int32)})
        >>> bool(abs(float(loss) - jnp.log(256.0)) < 0.5)
        True
    """
    tokens = batch["tokens"]
    if rng is None:
        logits: Any = model.apply({"params": params}, tokens[:, :-1])
    else:
        logits = model.apply({"params": params}, tokens[:, :-1], True, rngs={"dropout": rng})
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:])
    return jnp.mean(ce)


def generate(
    model: GPT, params: Any, prompt: bytes, length: int, key: jax.Array, temperature: float = 0.8
) -> bytes:
    """Sample ``length`` bytes after ``prompt`` (a sliding window of ``context`` bytes).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> model = GPT(GPTConfig(layers=1, width=16, heads=2, context=8))
        >>> p = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> len(generate(model, p, b"def ", 5, jax.random.key(1)))
        5
    """
    ctx = model.cfg.context

    @jax.jit
    def next_byte(window: jax.Array, n: jax.Array, k: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, window[None])[0]
        last = jax.lax.dynamic_index_in_dim(logits, n - 1, keepdims=False)
        return jax.random.categorical(k, last.astype(jnp.float32) / temperature)

    seq = list(prompt) or [10]
    out = bytearray()
    for i in range(length):
        window = seq[-ctx:]
        n = len(window)
        padded = jnp.asarray(window + [0] * (ctx - n), jnp.int32)
        b = int(next_byte(padded, jnp.int32(n), jax.random.fold_in(key, i)))
        seq.append(b)
        out.append(b)
    return bytes(out)
