"""A small language model on variable-length, padded sequences, with a per-token loss.

Sequences of 3 to 12 tokens are padded to 12 with token 0 and come with a mask of the real
tokens. The loss is the mean over the *real target tokens of the whole global batch*: every
token weighs the same, whichever micro-batch and rank it lands on. That is jaxdp's per-token
mode (docs/loss-contract.md, "Per-token loss with a padding mask"):

* ``DDPConfig(calculate_per_token_loss=True)``;
* ``loss_fn`` returns ``jaxdp.LossOutput(loss_sum, num_tokens=...)``: the *sum* of the masked
  token losses of its micro-batch and the number of tokens it summed; the engine divides the
  summed gradients by the token count of the whole step (all micro-batches, all ranks);
* ``metrics["loss"]`` is then the per-token mean over the global batch and
  ``metrics["num_tokens"]`` that token count;
* token accuracy is returned in ``aux`` as a *sum* (``aux`` is an unweighted mean over
  micro-batches and ranks): ``aux["correct"] * dp * G / num_tokens`` is the token-weighted
  accuracy.

The model is an embedding, one hidden layer over the current and the previous token, dropout
(the engine's key) and a readout. The language is a walk through the tokens 1..15 with a
stride of 1, 2 or 3 per sequence: from the third token on, the last two tokens give the next.
Batches are NumPy arrays (int64 tokens, bool mask) straight from the generator.

Run:  python examples/padded_lm.py [--steps 60] [--stage 1] [--microbatches 2] [--devices 6]
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # 8 simulated CPU devices, before jax starts
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdp

VOCAB, PAD, SEQ = 16, 0, 12


def sequences(n: int, seed: int) -> dict[str, np.ndarray]:
    """``n`` sequences of 3 to ``SEQ`` tokens, padded with ``PAD``: ``tokens`` ``[n, SEQ]``
    (int64, NumPy's default) and ``mask`` ``[n, SEQ]`` (bool, True at real tokens)."""
    rs = np.random.default_rng(seed)
    lengths = rs.integers(3, SEQ + 1, n)
    start, stride = rs.integers(1, VOCAB, n), rs.integers(1, 4, n)
    pos = np.arange(SEQ)
    tokens = (start[:, None] - 1 + stride[:, None] * pos) % (VOCAB - 1) + 1
    mask = pos[None, :] < lengths[:, None]
    return {"tokens": np.where(mask, tokens, PAD), "mask": mask}


class TinyLM(nn.Module):
    """Logits for the next token from the current and the previous one."""

    width: int = 32
    dropout: float = 0.1

    @nn.compact
    def __call__(self, tokens, *, train: bool):
        e = nn.Embed(VOCAB, self.width)(tokens)
        prev = jnp.pad(e, ((0, 0), (1, 0), (0, 0)))[:, :-1]  # the token before (zeros at 0)
        h = nn.gelu(nn.Dense(self.width)(jnp.concatenate([e, prev], -1)))
        h = nn.Dropout(self.dropout, deterministic=not train)(h)
        return nn.Dense(VOCAB)(h)


def token_sums(logits, batch):
    """``(loss_sum, num_tokens, correct)`` over the real next-token targets of ``batch``:
    position ``i`` predicts token ``i + 1``, counted where that token is real."""
    targets = batch["tokens"][:, 1:]
    mask = batch["mask"][:, 1:].astype(jnp.float32)
    logits = logits[:, :-1]
    token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return jnp.sum(token_loss * mask), jnp.sum(mask), jnp.sum(correct * mask)


def make_loss_fn(model: TinyLM):
    """The per-token ``loss_fn`` for ``DDPConfig(calculate_per_token_loss=True)``."""

    def loss_fn(params, batch, *, rng):
        logits = model.apply({"params": params}, batch["tokens"], train=True, rngs={"dropout": rng})
        loss_sum, num_tokens, correct = token_sums(logits, batch)
        return jaxdp.LossOutput(loss_sum, aux={"correct": correct}, num_tokens=num_tokens)

    return loss_fn


def reference_loss(model: TinyLM, params, batch):
    """The objective on one device, in plain jax: the mean loss over the real target tokens of
    the whole global batch (no dropout)."""
    logits = model.apply({"params": params}, batch["tokens"], train=False)
    loss_sum, num_tokens, _ = token_sums(logits, batch)
    return loss_sum / num_tokens


def main(argv=None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=48, help="global batch (default: %(default)s)")
    p.add_argument("--stage", type=int, default=1, help="ZeRO stage (default: %(default)s)")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--devices", type=int, default=None, help="default: all")
    p.add_argument("--dropout", type=float, default=0.1)
    args = p.parse_args(argv)

    model = TinyLM(dropout=args.dropout)
    params = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32), train=False)["params"]
    cfg = jaxdp.DDPConfig(
        zero_stage=args.stage,
        num_microbatches=args.microbatches,
        calculate_per_token_loss=True,  # normalise by the step's token count
    )
    mesh = jaxdp.make_mesh(jax.devices()[: args.devices])
    engine = jaxdp.DataParallel(make_loss_fn(model), optax.adam(1e-2), cfg, mesh=mesh)
    state = engine.init(params, rng=jax.random.key(1))
    micro = engine.dp * cfg.num_microbatches  # micro-batches per step, over all ranks
    losses = []
    for step in range(args.steps):
        batch = sequences(args.batch, seed=step)
        state, metrics = engine.step(state, engine.shard_batch(batch))
        # Reading the loss every step also bounds the steps in flight: on a busy 2-core host,
        # hundreds of unread steps over simulated CPU devices stalled XLA:CPU's collective
        # rendezvous (a plain jax.jit with a psum as well), and the process aborted.
        losses.append(float(metrics["loss"]))
    tokens = float(metrics["num_tokens"])
    train_acc = float(metrics["aux"]["correct"]) * micro / tokens  # aux holds means of sums

    held_out = sequences(1000, seed=10**6)
    eval_loss = float(
        jax.jit(reference_loss, static_argnums=0)(model, engine.params(state), held_out)
    )
    logits = jax.jit(lambda p, t: model.apply({"params": p}, t, train=False))(
        engine.params(state), held_out["tokens"]
    )
    _, n, correct = token_sums(logits, held_out)
    eval_acc = float(correct / n)
    print(
        f"padded LM on {engine.dp} devices, stage {args.stage}, G={args.microbatches}, "
        f"{args.steps} steps: loss {float(metrics['loss']):.3f} per token over "
        f"{tokens:.0f} target tokens, token accuracy {train_acc:.3f}; held out: loss "
        f"{eval_loss:.3f}, token accuracy {eval_acc:.3f}"
    )
    return {"losses": losses, "eval_loss": eval_loss, "eval_accuracy": eval_acc}


if __name__ == "__main__":
    main()
