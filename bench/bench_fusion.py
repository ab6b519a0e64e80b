"""Gradient-accumulation fusion: step time with vs without, and what XLA emits for the GEMM.

Three parts, each a section of BENCHMARKS.md (``markdown(run())``):

1. **Numerics.** One ``jaxdp.nn.Dense`` (bf16 working params and inputs, 64 -> 32), G = 8
   micro-batches, 8 devices, ``grad_reduce_in_fp32=True``: relative Frobenius error of the reduced
   weight gradient against a float64 reference, fused and unfused.
2. **CPU step time** on 8 simulated devices: an MLP of ``jaxdp.nn.Dense`` layers (bf16 params,
   AdamW, G = 4) at ZeRO stages 0 and 1, fused vs unfused, compiled first, then timed round-robin
   (median over rounds). XLA:CPU rewrites bf16 dots to f32, so this measures the cost of the
   mechanism's extra casts, not a GEMM speed-up.
3. **8 compile-only H100s** (needs the ``gpu-aot`` extra): the weight-gradient GEMM of the same
   MLP, fused and unfused: operand/result dtypes, kernel kind, and what consumes its result.

On a GPU host, ``python bench/bench_fusion.py --gpu`` times fused vs unfused on the local GPUs
(the seed's claim is +2-5 % end to end); it was not run for this report (no GPU was available).
Run: ``python bench/bench_fusion.py [--quick]``.
"""

from __future__ import annotations

import os
import sys

import _harness as H

os.environ.update({} if "--gpu" in sys.argv else H.cpu_devices(8))

import argparse
import re
import time
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _models import BF16, dense_mlp_problem

from jaxdp import DataParallel, DDPConfig, nn


# ---------------------------------------------------------------- 1. numerics
def numerics(g: int = 8, rows: int = 16, d_in: int = 64, d_out: int = 32) -> dict[str, float]:
    """Relative error of the reduced weight gradient vs float64, fused and unfused (stage 0)."""
    dp_size = jax.device_count()
    n = g * dp_size * rows
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, d_in)), BF16)
    t = jnp.asarray(rng.standard_normal((n, d_out)), BF16)
    ref = np.asarray(x, np.float64).T @ np.asarray(t, np.float64) / n
    layer = nn.Dense(d_out, use_bias=False, dtype=BF16)
    params = layer.init(jax.random.key(0), x[:1])["params"]

    def loss_fn(p, mb):
        y = layer.apply({"params": p}, mb["x"]).astype(jnp.float32)
        return jnp.sum(y * mb["t"].astype(jnp.float32)) / mb["x"].shape[0]

    capture = optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p),
        lambda gr, s, p=None: (jax.tree.map(jnp.zeros_like, gr), gr),
    )
    out = {}
    for fuse in (True, False):
        cfg = DDPConfig(
            num_microbatches=g,
            param_dtype="bfloat16",
            grad_reduce_in_fp32=True,
            gradient_accumulation_fusion=fuse,
        )
        dp = DataParallel(loss_fn, capture, cfg)
        state = dp.init(params)
        state, _ = dp.step(state, dp.shard_batch({"x": x, "t": t}))
        got = np.asarray(state.opt_state["kernel"], np.float64)
        out["fused" if fuse else "unfused"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    return out


# ---------------------------------------------------------------- 2. step time
def step_times(
    width: int,
    depth: int,
    batch: int,
    g: int,
    stages: tuple[int, ...],
    rounds: int,
    inner: int,
    dump: str | None = None,
) -> list[dict[str, Any]]:
    loss_fn, params, data = dense_mlp_problem(width, depth, batch)
    variants = []
    for stage in stages:
        for fuse in (False, True):
            cfg = DDPConfig(
                zero_stage=stage,
                num_microbatches=g,
                param_dtype="bfloat16",
                grad_reduce_in_fp32=True,
                gradient_accumulation_fusion=fuse,
            )
            dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg)
            state = dp.init(params)
            b = dp.shard_batch(data)
            t0 = time.perf_counter()
            compiled = dp.step.lower(state, b).compile()
            if dump:  # the compiled program, to read what the GEMMs accumulate into
                name = f"fusion_stage{stage}_{'fused' if fuse else 'unfused'}_{batch}.hlo"
                with open(os.path.join(dump, name), "w") as f:
                    f.write(compiled.as_text())
            variants.append(
                {
                    "stage": stage,
                    "fused": fuse,
                    "dp": dp,
                    "state": state,
                    "batch": b,
                    "compile_s": time.perf_counter() - t0,
                    "compiled": compiled,
                }
            )

    def run(v: dict[str, Any]) -> Any:
        def steps(k: int) -> Any:
            for _ in range(k):
                v["state"], _ = v["dp"].step(v["state"], v["batch"])
            return jax.block_until_ready(v["state"])

        return steps

    times = H.rounds({str(i): run(v) for i, v in enumerate(variants)}, rounds, inner)
    for i, v in enumerate(variants):
        v["times"] = times[str(i)]
    return [
        {
            "stage": v["stage"],
            "fused": v["fused"],
            "ms": 1e3 * H.median(v["times"]),
            "compile_s": v["compile_s"],
        }
        for v in variants
    ]


# ---------------------------------------------------------------- 3. H100 compile-only
_HEADER = re.compile(r"^%(\S+) \((.*)\) -> (\S+) \{$")
_INDEX = re.compile(r"/\*index=\d+\*/")


def _computations(text: str) -> dict[str, tuple[str, str, list[str]]]:
    comps: dict[str, tuple[str, str, list[str]]] = {}
    name: str | None = None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            name = m.group(1)
            comps[name] = (m.group(2), m.group(3), [])
        elif name and line.startswith("}"):
            name = None
        elif name:
            comps[name][2].append(line)
    return comps


def wgrad_report(text: str, width: int) -> list[str]:
    """One line per weight-gradient GEMM: kernel, operand -> result dtypes, consumer."""
    comps = _computations(text)
    lines = []
    for line in text.splitlines():
        m = re.search(r"%(\S+) = (\S+) fusion\(.*kind=(\w+), calls=%([^,\s]+)", line)
        if not m or m.group(4) not in comps:
            continue
        params, result, body = comps[m.group(4)]
        if not (f"[{width},{width}]" in result and "transpose(jvp(" in "\n".join(body)):
            continue
        if not any(" dot(" in b for b in body):
            continue
        kind = re.search(r'"kind":"(\w+)"', line)
        ops = sorted(set(re.findall(r"(bf16|f32)\[", params)))
        uses = []
        for other in text.splitlines():
            other = _INDEX.sub("", other)  # operand lists carry /*index=N*/ comments
            if re.search(rf"[(,] ?%{re.escape(m.group(1))}[,)]", other):
                u = re.search(r"%(\S+) = (\S+?)(?:\{[^}]*\})? (\S+?)\(", other)
                called = re.search(r"calls=%([^,\s]+)", other)
                ops_in = "\n".join(comps[called.group(1)][2]) if called else ""
                if u and " add(" in ops_in:
                    how = "converted to f32 there" if result.startswith("bf16") else "no convert"
                    uses.append(
                        f"summed into the accumulator by `{u.group(2)}` {u.group(3)} ({how})"
                    )
        where = "; ".join(uses[:1]) or "consumed by a fusion without the add"
        emitter = kind.group(1) if kind else m.group(3)
        lines.append(f"{'+'.join(ops)} operands -> `{result}` ({emitter}); {where}")
    return lines


def h100(width: int, depth: int, batch: int, g: int) -> dict[str, Any]:
    from jaxdp import aot

    mesh, why = H.h100_mesh(8)
    if mesh is None:
        return {"skipped": why}
    loss_fn, params, data = dense_mlp_problem(width, depth, batch)
    out: dict[str, Any] = {}
    for fuse in (False, True):
        cfg = DDPConfig(
            num_microbatches=g,
            param_dtype="bfloat16",
            grad_reduce_in_fp32=True,
            gradient_accumulation_fusion=fuse,
        )
        dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=mesh)
        batch_abs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), data)
        text = aot.compile_step(dp, params, batch_abs).as_text()
        counts = Counter(wgrad_report(text, width))
        out["fused" if fuse else "unfused"] = [f"{n} x {line}" for line, n in counts.items()]
    return out


# ---------------------------------------------------------------- GPU timing (not run here)
def gpu(width: int = 4096, depth: int = 8, batch: int = 64, g: int = 8) -> None:
    """Fused vs unfused step time on the local GPUs (run on a GPU host)."""
    res = step_times(width, depth, batch * jax.device_count() * g, g, (0, 1), rounds=20, inner=5)
    for r in res:
        print(f"stage {r['stage']} fused={r['fused']}: {r['ms']:.2f} ms/step")


# ---------------------------------------------------------------- entry points
def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    width, depth, g = (256, 3, 4) if quick else (512, 4, 4)
    batch = 8 * g * 16
    res: dict[str, Any] = {
        "config": {"width": width, "depth": depth, "g": g, "batch": batch},
        "numerics": numerics(),
        "steps": step_times(
            width, depth, batch, g, (0, 1), rounds=3 if quick else 10, inner=1 if quick else 2
        ),
        "h100": h100(width, depth, batch, g),
    }
    res["markdown"] = markdown(res)
    return res


def markdown(res: dict[str, Any]) -> str:
    c, num = res["config"], res["numerics"]
    out = [
        "### Numerics (`jaxdp.nn.Dense`, bf16 params and inputs, G = 8, dp = 8, "
        "`grad_reduce_in_fp32=True`)",
        "",
        "| path | rel. Frobenius error of the reduced weight gradient vs float64 |",
        "|---|---:|",
        f"| fused | {num['fused']:.2e} |",
        f"| unfused | {num['unfused']:.2e} |",
        "",
        f"### CPU step time (8 simulated devices; MLP of {c['depth']} `jaxdp.nn.Dense` "
        f"{c['width']}x{c['width']}, bf16 params, AdamW, G = {c['g']}, global batch "
        f"{c['batch']})",
        "",
        "| stage | unfused ms | fused ms | fused / unfused | compile s (unfused, fused) |",
        "|---:|---:|---:|---:|---|",
    ]
    by = {(r["stage"], r["fused"]): r for r in res["steps"]}
    for stage in sorted({r["stage"] for r in res["steps"]}):
        u, f = by[(stage, False)], by[(stage, True)]
        out.append(
            f"| {stage} | {u['ms']:.2f} | {f['ms']:.2f} | {f['ms'] / u['ms']:.2f} "
            f"| {u['compile_s']:.1f}, {f['compile_s']:.1f} |"
        )
    out += [
        "",
        H.reading("bench_fusion"),
        "",
        "### Weight-gradient GEMM on 8 compile-only H100s (stage 0, same MLP)",
        "",
    ]
    h = res["h100"]
    if "skipped" in h:
        out.append(f"Skipped: {h['skipped']}")
    else:
        for key in ("unfused", "fused"):
            out.append(f"* {key}: " + " / ".join(h[key]))
        out += ["", H.reading("bench_fusion", "h100", depth=c["depth"])]
    return "\n".join([*out, "", H.reading("bench_fusion", "gpu")])


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer rounds")
    ap.add_argument("--gpu", action="store_true", help="time on the local GPUs instead")
    args = ap.parse_args(argv)
    if args.gpu:
        gpu()
        return None
    res = result(quick=args.quick)
    print(res["markdown"])
    return res


if __name__ == "__main__":
    main()
