"""GPU benchmark: jaxdp at every ZeRO stage against the bare jitted step, in one command.

Meant for a machine with NVIDIA GPUs (nothing here needs one: ``--tiny`` runs a small model on
the CPU as a check of the script). Same process, same model (``jaxdp.models.GPT``, cuDNN flash
attention through ``jax.nn.dot_product_attention``), same per-device batch:

* **bare**: ``jax.jit`` of value_and_grad + AdamW on one device, bf16 working params with an
  fp32 master copy (what jaxdp's ``param_dtype="bfloat16"`` keeps), no collectives;
* **jaxdp**: ``DataParallel`` at stages 0-3 x ``G`` in {1, 4} on all local devices,
  ``param_dtype="bfloat16"``, default buckets; XLA flags from :func:`jaxdp.apply_xla_flags`
  are set before jax starts;
* **fusion**: ``bench_fusion.py``'s MLP of 8 ``jaxdp.nn.Dense`` 4096x4096 (bf16, ``G = 8``)
  with ``gradient_accumulation_fusion`` off and on.

Per variant: the first call (trace + compile) in seconds; **blocking** ms/step (median,
``block_until_ready`` after every step); **pipelined** ms/step (15 steps dispatched back to
back, one block, median of rounds); **host ms/call**: how long each of those pipelined
calls takes to return (the host's dispatch work per step); **device busy** ms/step (a
``jax.profiler`` trace of 5 pipelined steps read with ``jax.profiler.ProfileData``: the
union of the GPU streams' op intervals, divided by 5); **peak** memory of the compiled
program (arguments + outputs - aliased + temp, ``memory_analysis()``); and **MFU** =
``tokens/s x (6 N + 12 L T d) / (devices x peak)`` from the pipelined time.

Run on a GPU host (the default model is the 303M-parameter GPT of ``configs/gpt_300m_gpu.yaml``)::

    python bench/bench_gpu.py --write BENCHMARKS.md   # also replaces BENCHMARKS.md's GPU section

Check on a CPU: ``python bench/bench_gpu.py --tiny``.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch-per-device", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and mode")
    p.add_argument("--peak-tflops", type=float, default=None, help="default: by device kind")
    p.add_argument("--no-fusion", action="store_true", help="skip the fused / unfused MLP")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to run, e.g. 1,3")
    p.add_argument("--accum", default="1,4", help="micro-batch counts G to run, e.g. 4")
    p.add_argument("--write", default=None, help="replace this BENCHMARKS.md's GPU section")
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
from jaxdp.train._mfu import peak_tflops, train_flops_per_token  # noqa: E402

START, END = "<!-- bench_gpu:start -->", "<!-- bench_gpu:end -->"
PIPELINE = 15


def busy_ms(step: Any, state: Any, batch: Any, n: int = 5) -> tuple[float | None, Any]:
    """Device busy time per step from a profile: the union of the GPU op intervals."""
    folder = tempfile.mkdtemp(prefix="jaxdp-prof-")
    with jax.profiler.trace(folder):
        for _ in range(n):
            state, m = step(state, batch)
        jax.block_until_ready((state, m))
    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return None, state
    from jax.profiler import ProfileData

    spans = []
    for plane in ProfileData.from_file(files[0]).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            spans += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
    if not spans:
        return None, state
    spans.sort()
    total, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            total, lo, hi = total + hi - lo, a, b
        else:
            hi = max(hi, b)
    return (total + hi - lo) / 1e6 / n, state


def measure(step: Any, compiled: Any, state: Any, batch: Any, steps: int) -> dict[str, Any]:
    """Blocking and pipelined ms/step, device busy ms/step and compiled peak bytes."""
    state, m = step(state, batch)  # warm-up (compiled already)
    jax.block_until_ready(m)
    blocking = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        blocking.append(time.perf_counter() - t0)
    pipelined, host = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        calls = 0.0
        for _ in range(PIPELINE):
            t1 = time.perf_counter()
            state, m = step(state, batch)
            calls += time.perf_counter() - t1
        jax.block_until_ready((state, m))
        pipelined.append((time.perf_counter() - t0) / PIPELINE)
        host.append(calls / PIPELINE)
    busy, state = busy_ms(step, state, batch)
    mem = compiled.memory_analysis()
    peak = None
    if mem is not None:
        peak = (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        )
    return {
        "blocking_ms": 1e3 * statistics.median(blocking),
        "pipelined_ms": 1e3 * statistics.median(pipelined),
        "host_ms": 1e3 * statistics.median(host),
        "busy_ms": busy,
        "peak_gib": None if peak is None else peak / 2**30,
    }


def bare(model: GPT, params: Any, batch: Any, steps: int) -> dict[str, Any]:
    """Single device, no collectives: bf16 working params, fp32 master, AdamW."""
    opt = optax.adamw(1e-4)
    dev = jax.devices()[0]
    master = jax.tree.map(lambda x: jnp.array(x, copy=True), jax.device_put(params, dev))
    state = (master, opt.init(master))
    batch = jax.device_put(batch, dev)

    def step(state: Any, batch: Any) -> Any:
        master, opt_state = state
        work = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
        loss, grads = jax.value_and_grad(lambda p: next_byte_loss(model, p, batch))(work)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = opt.update(grads, opt_state, master)
        return (optax.apply_updates(master, updates), opt_state), loss

    jitted = jax.jit(step, donate_argnums=0)
    t0 = time.perf_counter()
    compiled = jitted.lower(state, batch).compile()
    out = {"compile_s": time.perf_counter() - t0}
    return {**out, **measure(compiled, compiled, state, batch, steps)}


def engine(model: GPT, params: Any, batch: Any, steps: int, stage: int, g: int) -> dict[str, Any]:
    cfg = jaxdp.DDPConfig(zero_stage=stage, num_microbatches=g, param_dtype="bfloat16")
    dp = jaxdp.DataParallel(lambda p, b: next_byte_loss(model, p, b), optax.adamw(1e-4), cfg)
    state = dp.init(params, example_batch=batch)
    b = dp.shard_batch(batch)
    t0 = time.perf_counter()
    compiled = dp.step.lower(state, b).compile()
    out = {"compile_s": time.perf_counter() - t0}
    return {**out, **measure(compiled, compiled, state, b, steps)}


def fusion(tiny: bool, steps: int) -> list[dict[str, Any]]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_fusion

    width, depth, rows = (256, 2, 16) if tiny else (4096, 8, 8192)
    g = 8
    return bench_fusion.step_times(
        width, depth, rows * jax.device_count() * g, g, (0, 1), rounds=steps, inner=5
    )


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(head: str, rows: list[tuple[str, dict[str, Any], int]], fuse: Any, mfu: Any) -> str:
    base = rows[0][1]
    lines = [
        head,
        "",
        "| variant | blocking ms | pipelined ms | vs bare (pipelined) | device busy ms | "
        "host ms/call | host vs bare | first call s | compile vs bare | peak GiB | MFU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r, devices in rows:
        util = mfu(r["pipelined_ms"], devices)
        lines.append(
            f"| {name} | {r['blocking_ms']:.1f} | {r['pipelined_ms']:.1f} | "
            f"{r['pipelined_ms'] / base['pipelined_ms']:.3f}x | {_f(r['busy_ms'], '.1f')} | "
            f"{r['host_ms']:.2f} | {r['host_ms'] / base['host_ms']:.2f}x | "
            f"{r['compile_s']:.1f} | {r['compile_s'] / base['compile_s']:.2f}x | "
            f"{_f(r['peak_gib'], '.2f')} | {_f(util, '.1%')} |"
        )
    if fuse:
        lines += ["", "| fusion (8 x jaxdp.nn.Dense, G = 8) | ms/step | first call s |"]
        lines.append("|---|---:|---:|")
        for r in fuse:
            lines.append(
                f"| stage {r['stage']}, fused={r['fused']} | {r['ms']:.2f} | {r['compile_s']:.1f} |"
            )
    return "\n".join(lines)


def write_section(path: str, body: str) -> None:
    """Replace the text between the bench_gpu markers of ``path`` (append them if missing)."""
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    block = f"{START}\n{body}\n{END}"
    if START in text and END in text:
        text = text[: text.index(START)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n## GPU: `bench/bench_gpu.py`\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv) if argv is not None else ARGS
    assert args is not None
    if args.tiny:
        args.layers, args.width, args.heads, args.context, args.steps = 2, 64, 4, 32, 2
        args.batch_per_device = 4
    n = jax.device_count()
    cfg = GPTConfig(
        layers=args.layers, width=args.width, heads=args.heads, context=args.context, scan=True
    )
    model = GPT(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, cfg.context), jnp.int32))["params"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)

    def tokens(rows: int) -> dict[str, Any]:
        return {"tokens": rng.integers(0, 256, (rows, cfg.context + 1)).astype(np.int32)}

    bpd = args.batch_per_device
    dev = jax.devices()[0]
    peak = args.peak_tflops or peak_tflops(dev.device_kind)
    per_token = train_flops_per_token(cfg, n_params)

    def mfu(ms: float, devices: int) -> float | None:
        if peak is None:
            return None
        return bpd * devices * cfg.context / (ms / 1e3) * per_token / (devices * peak * 1e12)

    head = (
        f"{n} x {dev.device_kind} ({dev.platform}), jax {jax.__version__}; GPT "
        f"{n_params / 1e6:.1f}M params ({cfg.layers} x {cfg.width}, {cfg.heads} heads, context "
        f"{cfg.context}, nn.scan), {bpd} sequences per device per step, bf16 working params, "
        f"fp32 master, AdamW; MFU against {_f(peak, '.0f')} TFLOP/s per device."
    )
    print(head, flush=True)
    rows = [("bare jit, 1 device", bare(model, params, tokens(bpd), args.steps), 1)]
    print(rows[-1][0], rows[-1][1], flush=True)
    for stage in [int(s) for s in args.stages.split(",")]:
        for g in [int(a) for a in args.accum.split(",")]:
            r = engine(model, params, tokens(bpd * n), args.steps, stage, g)
            rows.append((f"jaxdp stage {stage}, G = {g}, {n} devices", r, n))
            print(rows[-1][0], r, flush=True)
    fuse = None if args.no_fusion else fusion(args.tiny, args.steps)
    md = markdown(head, rows, fuse, mfu)
    print("\n" + md)
    if args.write:
        write_section(args.write, md)
        print(f"wrote the GPU section of {args.write}")
    return md


if __name__ == "__main__":
    main()
