"""The main job's GPT training, as one readable script (``jaxdp-train`` does the same, with
flags, logs, plots and multi-process support).

A byte-level GPT learns the Python standard library's own source on 8 simulated CPU devices,
with ZeRO-1 and a checkpoint at the end that restores exactly on any device count.

Run:  python examples/train_gpt.py [--steps 100] [--out /tmp/gpt-example]
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # 8 simulated CPU devices, before jax starts
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdp
from jaxdp.models import GPT, GPTConfig, generate, next_byte_loss
from jaxdp.train._data import batch_rows, load_corpus


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default="/tmp/jaxdp-gpt-example")
    args = p.parse_args(argv)

    cfg = GPTConfig(layers=2, width=128, heads=4, context=64)
    corpus = load_corpus(None, cfg.context)  # stdlib .py files, split by file into train/val
    model = GPT(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, cfg.context), jnp.int32))["params"]

    # Megatron's batch arithmetic: 32 sequences = 4 per rank per pass x 1 micro-batch x 8 ranks.
    dp, global_batch, micro = jax.device_count(), 32, 4
    ddp = jaxdp.DDPConfig(
        zero_stage=1, clip_grad=1.0, num_microbatches=jaxdp.microbatches(global_batch, micro, dp)
    )
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, max(args.steps, 11), 3e-4)
    optimizer = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1)
    engine = jaxdp.DataParallel(lambda p, b: next_byte_loss(model, p, b), optimizer, ddp)
    state = engine.init(params)

    for step in range(1, args.steps + 1):
        tokens = batch_rows(corpus.train, 0, step, global_batch, cfg.context, slice(None))
        state, metrics = engine.step(state, engine.shard_batch({"tokens": tokens}))
        if step % 20 == 0 or step == 1:
            print(f"step {step:4d}  loss {float(metrics['loss']):.3f}")

    final = engine.params(state)
    val = batch_rows(corpus.val, 1, 0, global_batch, cfg.context, slice(None))
    val_loss = float(next_byte_loss(model, final, {"tokens": jnp.asarray(val)}))
    print(f"validation loss {val_loss:.3f} nats (unigram entropy {corpus.unigram_entropy():.3f})")

    with jaxdp.CheckpointManager(os.path.join(args.out, "checkpoints"), engine) as ckpt:
        ckpt.save(args.steps, state)
    # The checkpoint restores into another device count (here 4) exactly.
    small = jaxdp.DataParallel(
        engine.loss_fn, optimizer, ddp.replace(num_microbatches=2), mesh=jax.devices()[:4]
    )
    jax.eval_shape(small.init, params)
    with jaxdp.CheckpointManager(os.path.join(args.out, "checkpoints"), small) as ckpt:
        restored = small.params(ckpt.restore())
    same = all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(restored))
    )
    print(f"restored on 4 devices, identical params: {same}")
    print(
        "sample:", generate(model, final, b"def ", 120, jax.random.key(0)).decode(errors="replace")
    )


if __name__ == "__main__":
    main()
