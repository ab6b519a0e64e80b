"""GPU benchmark: jaxdp's step against the bare jitted single-device step, with MFU.

Meant for a machine with NVIDIA GPUs (nothing here needs one: ``--tiny`` runs a small model on
the CPU as a check of the script). Same process, same model, same per-device batch:

* **bare**: ``jax.jit`` of value_and_grad + AdamW on one device, bf16 working params with an
  fp32 master copy (what jaxdp's ``param_dtype="bfloat16"`` keeps), no collectives;
* **jaxdp**: ``DataParallel`` at ZeRO stage 1 on all local devices, ``param_dtype="bfloat16"``,
  default buckets, with ``grad_reduce_in_fp32`` off and on; XLA flags from
  :func:`jaxdp.apply_xla_flags` are set before jax starts.

Reported: median step time, tokens/s, the overhead ratio jaxdp / bare (goal <= 1.02 on one GPU,
where jaxdp's collectives are no-ops; on several GPUs it includes the communication XLA could
not hide), and MFU = ``6 x params x tokens/s / (peak x devices)``.

Run on a GPU host::

    python bench/bench_gpu.py                      # ~350M-param byte-level GPT, bf16
    python bench/bench_gpu.py --layers 24 --width 1024 --peak-tflops 989

Check on a CPU: ``python bench/bench_gpu.py --tiny``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch-per-device", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument(
        "--peak-tflops", type=float, default=989.0, help="bf16 dense peak per device (H100 SXM)"
    )
    p.add_argument("--tiny", action="store_true", help="small model on the CPU (script check)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and "jax" not in sys.modules:
    if ARGS.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        import jaxdp as _jaxdp

        # The combine thresholds follow the default bucket size; set before jax starts.
        _jaxdp.apply_xla_flags(_jaxdp.DDPConfig(zero_stage=1, param_dtype="bfloat16"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp.models import GPT, GPTConfig, next_byte_loss  # noqa: E402


def _median_step(step: Any, state: Any, batch: Any, steps: int) -> tuple[float, Any]:
    state, _ = step(state, batch)  # compile + warm-up
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def bare_step(model: GPT, params: Any, batch: Any, steps: int) -> float:
    """Single device, no collectives: bf16 working params, fp32 master, AdamW."""
    opt = optax.adamw(1e-4)
    dev = jax.devices()[0]
    master = jax.tree.map(lambda x: jnp.array(x, copy=True), jax.device_put(params, dev))
    state = (master, opt.init(master))
    batch = jax.device_put(batch, dev)

    def step(state, batch):
        master, opt_state = state
        work = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
        loss, grads = jax.value_and_grad(lambda p: next_byte_loss(model, p, batch))(work)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = opt.update(grads, opt_state, master)
        return (optax.apply_updates(master, updates), opt_state), loss

    t, _ = _median_step(jax.jit(step, donate_argnums=0), state, batch, steps)
    return t


def jaxdp_step(model: GPT, params: Any, batch: Any, steps: int, fp32: bool) -> float:
    cfg = jaxdp.DDPConfig(zero_stage=1, param_dtype="bfloat16", grad_reduce_in_fp32=fp32)
    engine = jaxdp.DataParallel(lambda p, b: next_byte_loss(model, p, b), optax.adamw(1e-4), cfg)
    state = engine.init(params)
    t, _ = _median_step(engine.step, state, engine.shard_batch(batch), steps)
    return t


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv) if argv is not None else ARGS
    assert args is not None
    if args.tiny:
        args.layers, args.width, args.heads, args.context, args.steps = 2, 64, 4, 32, 3
        args.batch_per_device = 2
    n = jax.device_count()
    cfg = GPTConfig(layers=args.layers, width=args.width, heads=args.heads, context=args.context)
    model = GPT(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, cfg.context), jnp.int32))["params"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)

    def tokens(rows: int) -> dict[str, Any]:
        return {"tokens": rng.integers(0, 256, (rows, cfg.context + 1)).astype(np.int32)}

    bpd = args.batch_per_device
    dev = jax.devices()[0]
    print(
        f"{n} x {dev.device_kind} ({dev.platform}); GPT {n_params / 1e6:.1f}M params, "
        f"context {cfg.context}, {bpd} sequences per device",
        flush=True,
    )
    rows = [("bare jit, 1 device", bare_step(model, params, tokens(bpd), args.steps), 1)]
    for fp32 in (False, True):
        t = jaxdp_step(model, params, tokens(bpd * n), args.steps, fp32)
        rows.append((f"jaxdp stage 1, grad_reduce_in_fp32={fp32}, {n} devices", t, n))
    bare = rows[0][1]
    print("\n| variant | ms/step | tokens/s | overhead vs bare | MFU |")
    print("|---|---:|---:|---:|---:|")
    for name, t, devices in rows:
        tok_s = bpd * devices * cfg.context / t
        mfu = 6 * n_params * tok_s / (args.peak_tflops * 1e12 * devices)
        print(f"| {name} | {1e3 * t:.1f} | {tok_s:,.0f} | {t / bare:.3f}x | {mfu:.1%} |")


if __name__ == "__main__":
    main()
