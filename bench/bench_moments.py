"""Adam's moments in bfloat16 (``exp_avg_dtype``, ``exp_avg_sq_dtype``): loss and memory.

Two parts, one section of BENCHMARKS.md:

1. **Loss.** A small byte-level GPT (``jaxdp.models.GPT``, 2 layers x width 64, context 64)
   trained for 1,000 steps (global batch 16, ZeRO stage 1 over 2 simulated CPU devices, AdamW
   with warm-up and cosine decay, as ``jaxdp-train``) on ``jaxdp-train``'s default corpus (the
   Python standard library's sources), once with fp32 moments and once with bf16 moments, for
   ``b2 = 0.95`` (``jaxdp-train``'s) and ``b2 = 0.999`` (optax's default). The same data and
   initial params in both: the final train loss (mean of the last 50 steps), the validation
   loss, and their ratio bf16 / fp32; beside it, the ratio of an fp32 run from other params and
   batches (the spread of a seed, against which a rounding effect is read).
2. **Memory.** The optimizer state per device of the 100.7M GPT of section 11 (AdamW, bf16
   params, dp = 8), from the shardings of its state on 8 compile-only H100s (needs the
   ``gpu-aot`` extra; nothing compiles), against ``4 B x params / dp`` (bf16 moments) and
   ``8 B x params / dp`` (fp32).

Run: ``python bench/bench_moments.py [--quick]`` (``--quick``: a 1-layer GPT for 10 steps and
``b2 = 0.95`` only, the small GPT of section 11's quick run in part 2).
"""

from __future__ import annotations

import os

import _harness as H

os.environ.update(H.cpu_devices(8))

import argparse
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _models import gpt_problem

import jaxdp
from jaxdp import DataParallel, DDPConfig
from jaxdp.models.gpt import GPT, GPTConfig, next_byte_loss
from jaxdp.train._data import batch_rows, load_corpus

BF16 = {"exp_avg_dtype": "bfloat16", "exp_avg_sq_dtype": "bfloat16"}
MODEL = GPTConfig(layers=2, width=64, heads=2, context=64)
QUICK_MODEL = GPTConfig(layers=1, width=32, heads=2, context=32)
BATCH, LR, WARMUP, DEVICES, LAST = 16, 3e-3, 50, 2, 50


# ---------------------------------------------------------------- 1. loss
def train(
    cfg: GPTConfig, steps: int, b2: float, moments: dict[str, str], corpus: Any, seed: int = 0
) -> dict[str, Any]:
    """Final train loss (mean of the last steps) and validation loss of one run (``seed``:
    the initial params' and the batches')."""
    model = GPT(cfg)
    # jitted: flax's init op by op took 13 s on a loaded 2-core machine
    init = jax.jit(lambda k: model.init(k, jnp.zeros((1, cfg.context), jnp.int32))["params"])
    params = init(jax.random.key(seed))
    warmup = min(WARMUP, steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, warmup, steps, LR / 10)
    opt = optax.adamw(schedule, b1=0.9, b2=b2, weight_decay=0.1)

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return next_byte_loss(model, p, b)

    mesh = jaxdp.make_mesh(jax.devices()[:DEVICES])
    dp = DataParallel(loss_fn, opt, DDPConfig(zero_stage=1, **moments), mesh=mesh)
    state, losses = dp.init(params), []
    for step in range(steps):
        if step == 1:  # after the compile
            jax.block_until_ready(state)
            t0 = time.perf_counter()
        rows = batch_rows(corpus.train, seed, step, BATCH, cfg.context, slice(None))
        state, m = dp.step(state, dp.shard_batch({"tokens": rows}))
        losses.append(m["loss"])
    jax.block_until_ready(state)
    ms = 1e3 * (time.perf_counter() - t0) / (steps - 1)
    train_loss = float(np.mean(jax.device_get(losses[-min(LAST, steps) :])))
    val_fn = jax.jit(loss_fn)
    full = dp.params(state)
    val = []
    for i in range(8):
        rows = batch_rows(corpus.val, 1, i, 64, cfg.context, slice(None))
        val.append(float(val_fn(full, {"tokens": rows})))
    adam = state.opt_state[0]  # adamw: (ScaleByAdamState, ...)
    assert {x.dtype.name for x in jax.tree.leaves((adam.mu, adam.nu))} == {
        moments.get("exp_avg_dtype", "float32")
    }
    return {"train": train_loss, "val": float(np.mean(val)), "ms": ms}


def losses(cfg: GPTConfig, steps: int, b2s: tuple[float, ...]) -> list[dict[str, Any]]:
    corpus = load_corpus(None, cfg.context)
    out = []
    for b2 in b2s:
        fp32, bf16 = train(cfg, steps, b2, {}, corpus), train(cfg, steps, b2, BF16, corpus)
        other = train(cfg, steps, b2, {}, corpus, seed=1)  # the spread of fp32 runs alone
        out.append({"b2": b2, "fp32": fp32, "bf16": bf16, "seed": other})
        print(
            f"b2={b2}: train {fp32['train']:.4f} -> {bf16['train']:.4f} "
            f"({bf16['train'] / fp32['train']:.4f}), val {fp32['val']:.4f} -> {bf16['val']:.4f}"
        )
    return out


# ---------------------------------------------------------------- 2. memory
def memory(quick: bool) -> dict[str, Any]:
    mesh, why = H.h100_mesh(8)
    if mesh is None:
        return {"skipped": why}
    from jaxdp import aot

    loss_fn, params, batch, info = gpt_problem(quick, 1)
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(params))

    def per_device(tree: Any) -> int:
        return sum(
            math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
        )

    rows = []
    for stage in (0, 1, 2, 3):
        row: dict[str, Any] = {"stage": stage}
        for name, moments in (("fp32", {}), ("bf16", BF16)):
            cfg = DDPConfig(zero_stage=stage, param_dtype="bfloat16", **moments)
            dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=mesh)
            state = aot.abstract_state(dp, params, batch)
            row[name] = {"opt": per_device(state.opt_state), "state": per_device(state)}
        rows.append(row)
    return {"psi": psi, "what": info["what"], "rows": rows}


# ---------------------------------------------------------------- entry points
def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    cfg, steps, b2s = (QUICK_MODEL, 10, (0.95,)) if quick else (MODEL, 1000, (0.95, 0.999))
    res: dict[str, Any] = {
        "model": cfg,
        "steps": steps,
        "losses": losses(cfg, steps, b2s),
        "memory": memory(quick),
    }
    res["markdown"] = markdown(res)
    return res


def markdown(res: dict[str, Any]) -> str:
    m = res["model"]
    out = [
        f"### Loss: GPT of {m.layers} layers x width {m.width}, context {m.context}, "
        f"{res['steps']} steps",
        "",
        f"Global batch {BATCH}, ZeRO stage 1 on {DEVICES} simulated CPU devices, AdamW "
        f"(lr {LR}, {min(WARMUP, res['steps'] // 2)} warm-up steps, cosine decay to a tenth, "
        "weight decay 0.1, b1 0.9) on "
        "`jaxdp-train`'s default corpus; the same data and initial params (seed 0) in the "
        "fp32 and bf16 runs, and an fp32 run from other params and batches (seed 1) for the "
        "spread of runs that differ in more than rounding. Train "
        f"loss: the mean of the last {LAST} steps; validation: 8 batches of 64 held-out windows. "
        "CPU step times are a smoke check (the moments' casts), not a speed claim.",
        "",
        H.table(
            [
                "b2",
                "train loss fp32",
                "train loss bf16",
                "bf16 / fp32",
                "val loss fp32",
                "val loss bf16",
                "bf16 / fp32",
                "fp32 seed 1 / seed 0 (train, val)",
                "ms/step (fp32, bf16)",
            ],
            [
                [
                    r["b2"],
                    f"{r['fp32']['train']:.4f}",
                    f"{r['bf16']['train']:.4f}",
                    f"{r['bf16']['train'] / r['fp32']['train']:.5f}",
                    f"{r['fp32']['val']:.4f}",
                    f"{r['bf16']['val']:.4f}",
                    f"{r['bf16']['val'] / r['fp32']['val']:.5f}",
                    f"{r['seed']['train'] / r['fp32']['train']:.5f}, "
                    f"{r['seed']['val'] / r['fp32']['val']:.5f}",
                    f"{r['fp32']['ms']:.1f}, {r['bf16']['ms']:.1f}",
                ]
                for r in res["losses"]
            ],
            "rrrrrrrrr",
        ),
        "",
    ]
    mem = res["memory"]
    out += ["### Optimizer state per device on 8 compile-only H100s", ""]
    if "skipped" in mem:
        out.append(f"Skipped: {mem['skipped']}")
    else:
        psi, n = mem["psi"], 8
        out += [
            f"{mem['what']}: {psi:,} parameters, bf16 params, AdamW, dp = {n}; bytes per device "
            "from the shardings of the engine's state (nothing compiles). Formula: the moments' "
            "bytes per parameter over dp at stages 1-3 (4 B bf16, 8 B fp32), not divided at "
            "stage 0.",
            "",
            H.table(
                [
                    "stage",
                    "opt. state fp32 moments",
                    "opt. state bf16 moments",
                    "bf16 ÷ formula (4 B Ψ/N)",
                    "whole state fp32 → bf16",
                ],
                [
                    [
                        r["stage"],
                        f"{r['fp32']['opt'] / H.MIB:.1f} MiB",
                        f"{r['bf16']['opt'] / H.MIB:.1f} MiB",
                        f"{r['bf16']['opt'] / (4 * psi / (n if r['stage'] else 1)):.4f}",
                        f"{r['fp32']['state'] / H.MIB:.1f} → {r['bf16']['state'] / H.MIB:.1f} MiB",
                    ]
                    for r in mem["rows"]
                ],
                "rrrrr",
            ),
        ]
    return "\n".join(out)


def reading(res: dict[str, Any]) -> str:
    def worst(run: str) -> str:
        dist = [abs(r[run][k] / r["fp32"][k] - 1) for r in res["losses"] for k in ("train", "val")]
        return f"{100 * max(dist):.2f}"

    return H.reading(
        "bench_moments", worst=worst("bf16"), spread=worst("seed"), steps=f"{res['steps']:,}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke test: tiny models, 10 steps")
    args = ap.parse_args(argv)
    res = result(quick=args.quick)
    print(res["markdown"])
    print()
    print(reading(res))
    return res


if __name__ == "__main__":
    main()
