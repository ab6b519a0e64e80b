"""Memory traffic and peak of every ZeRO stage against GSPMD peers, compiled for 8 H100s.

Nothing executes (compile-only H100s, the ``gpu-aot`` extra). One >= 100M-parameter GPT of
``jaxdp.models`` (abstract params; bf16 working params, fp32 master, AdamW), ``G`` micro-batches,
compiled as:

* jaxdp ``zero_stage`` 0-3 (bf16 wire), and stages 1-2 with ``grad_reduce_in_fp32``, without
  and with ``gradient_accumulation_fusion`` (the model's dense layers are :mod:`jaxdp.nn`'s,
  so their weight-gradient GEMMs then write fp32 and nothing casts the gradients up);
* three plain-``jit`` GSPMD peers with the same model, optimizer and batch:
  **replicated** (fp32 master and Adam state replicated, batch sharded: XLA's partitioner
  all-reduces the gradients), **sharded** (master and Adam state sharded ``P("data")``, the
  bf16 params replicated where they are used: ZeRO-1's traffic, and a whole step's params
  alive at once), and **sharded + remat** (the same with the loss under ``jax.checkpoint``
  with stage 3's default rule, ``bench_zero3.gspmd_fsdp_step``, so the backward pass gathers
  the params again: FSDP).

Read from each program (``bench_remat.traffic``): the bytes read and written by every op that
is neither a GEMM nor a collective (a fusion that only slices a 1-D input, or a concatenation
of inputs, reads only the sliced elements), in fp32 gradient volumes (``4 Ψ`` bytes), the part of it
in the model's forward/backward (``jvp(``), the compiled peak (argument + output - aliased +
temp, ``memory_analysis()``), and the bytes of the gradient concatenations: unfused
``concatenate`` ops, and fusions whose output is a concatenation (perhaps scaled or cast), of
at least 1% of the params in bf16: what packing gradients into flat buckets costs (stage 0's
all-reduce buckets show it; a concatenate fused into a reduction writes nothing).

Goals (issue 21): stages 0-2 within 0.25 gradient volumes of the matching peer (stage 0:
replicated; 1-2: sharded), stage 3 at most the sharded + remat peer and its peak at most the
sharded peer's; no gradient concatenation at stages 1-2.

Run: ``JAX_PLATFORMS=cpu python bench/bench_traffic.py [--quick] [--g 1]``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import math
import re
import time
from typing import Any

import _harness as H
import jax
import optax
from _models import gpt_problem
from bench_remat import _COMP, _INSTR, _split_shape, traffic
from bench_zero3 import compile_peer

from jaxdp import DataParallel, DDPConfig, aot

N = 8
_DIMS = re.compile(r"\b(?:pred|[suf]\d+|bf16|f8\w*)\[([0-9,]*)\]")


def concat_bytes(text: str, min_bytes: int) -> int:
    """Output bytes of the unfused ``concatenate`` ops and of the fusions whose output is a
    concatenation, each of at least ``min_bytes`` (smaller ones are scalars and norms, not
    gradient packs). A concatenate inside a fusion that reduces it writes nothing to memory."""
    body: dict[str, list[tuple[str, str]]] = {}
    cur = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(1)
            body[cur] = []
            continue
        m = _INSTR.match(line)
        if cur is None or not m:
            continue
        shape, tail = _split_shape(m.group(2))
        body[cur].append((shape, tail))
    fused = {
        c.group(1)
        for ins in body.values()
        for _, tail in ins
        if tail.startswith("fusion(")
        for c in [re.search(r"calls=%([\w.\-]+)", tail)]
        if c
    }

    def elements(shape: str) -> int:
        return sum(math.prod(int(d) for d in dims.split(",") if d) for dims in _DIMS.findall(shape))

    def builds_output(comp: str, n: int) -> bool:
        # the fusion's output is a concatenation (maybe scaled or cast): a concatenate inside
        # it with as many elements as the output
        return any(
            tail.startswith("concatenate(") and elements(shape) == n for shape, tail in body[comp]
        )

    total = 0
    for comp, ins in body.items():
        if comp in fused:
            continue
        for shape, tail in ins:
            op = tail.split("(", 1)[0]
            called = re.search(r"calls=%([\w.\-]+)", tail)
            n = elements(shape)
            if op == "concatenate" or (
                op == "fusion" and called is not None and builds_output(called.group(1), n)
            ):
                nbytes = H.array_bytes(shape)
                total += nbytes if nbytes >= min_bytes else 0
    return total


def _reading(compiled: Any, psi: int) -> dict[str, float]:
    text = compiled.as_text()
    t = traffic(text)
    vol = 4.0 * psi
    return {
        "traffic": t["all"] / vol,
        "model": t["model"] / vol,
        "peak GiB": H.total_bytes(compiled.memory_analysis()) / H.GIB,
        # 1% of the params in bf16: any bucket of gradients, no scalar
        "concat": concat_bytes(text, 2 * psi // 100) / vol,
    }


# Megatron's fp32 main-grad path: the weight-gradient GEMMs write fp32 (jaxdp.models.GPT's
# dense layers are jaxdp.nn's), so no pass casts bf16 gradients up before the reduce-scatter.
FP32_FUSED = {"grad_reduce_in_fp32": True, "gradient_accumulation_fusion": True}
# Issue 61's spike checks (Megatron's grad_norm_skip_threshold and check_for_large_grads), both on:
# what skipping an abnormal step costs a normal one (goal: at most 1% of the step).
SPIKES = {"grad_norm_skip_threshold": 100.0, "check_for_large_grads": True}
VARIANTS = (
    ("stage 0", {"zero_stage": 0}, "replicated"),
    ("stage 0, fp32 wire", {"zero_stage": 0, "grad_reduce_in_fp32": True}, "replicated"),
    ("stage 1", {"zero_stage": 1}, "sharded"),
    ("stage 1, fp32 wire", {"zero_stage": 1, "grad_reduce_in_fp32": True}, "sharded"),
    ("stage 2", {"zero_stage": 2}, "sharded"),
    ("stage 2, fp32 wire", {"zero_stage": 2, "grad_reduce_in_fp32": True}, "sharded"),
    ("stage 1, fp32 wire + fusion", {"zero_stage": 1, **FP32_FUSED}, "sharded"),
    ("stage 2, fp32 wire + fusion", {"zero_stage": 2, **FP32_FUSED}, "sharded"),
    ("stage 3", {"zero_stage": 3}, "sharded + remat"),
    ("stage 0, spike checks", {"zero_stage": 0, **SPIKES}, "replicated"),
    ("stage 1, spike checks", {"zero_stage": 1, **SPIKES}, "sharded"),
    ("stage 3, spike checks", {"zero_stage": 3, **SPIKES}, "sharded + remat"),
)


def run(quick: bool = False, g: int = 1) -> dict[str, Any]:
    """Every peer and variant (``quick``: a small GPT, the sharded peer and stages 0-1 only)."""
    mesh = aot.h100_mesh(N)
    loss_fn, params, batch, info = gpt_problem(quick, g, N)
    psi = sum(x.size for x in jax.tree.leaves(params))
    peers: dict[str, dict[str, float]] = {}
    rows = []
    kinds = ("replicated", "sharded") if quick else ("replicated", "sharded", "sharded + remat")
    variants = VARIANTS[:2] if quick else VARIANTS
    for kind in kinds:
        compiled, secs = compile_peer(loss_fn, optax.adamw(1e-4), g, mesh, params, batch, kind)
        peers[kind] = {**_reading(compiled, psi), "compile s": secs}
        rows.append({"program": f"GSPMD {kind}", **peers[kind]})
        print(rows[-1], flush=True)
    for name, extra, peer in variants:
        cfg = DDPConfig(num_microbatches=g, param_dtype="bfloat16", **extra)
        dp = DataParallel(loss_fn, optax.adamw(1e-4), cfg, mesh=mesh)
        t0 = time.perf_counter()
        compiled = aot.compile_step(dp, params, batch)
        row = {"program": f"jaxdp {name}", **_reading(compiled, psi)}
        row["compile s"] = time.perf_counter() - t0
        row["peer"] = peer
        row["vs peer"] = row["traffic"] - peers[peer]["traffic"]
        rows.append(row)
        print(row, flush=True)
    return {"psi": psi, "what": info["what"], "g": g, "rows": rows, "peers": peers}


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"{res['what']}, Ψ = {res['psi']:,}, G = {res['g']}, bf16 working params, fp32 master, "
        "AdamW, 8 compile-only H100s, jaxdp's XLA flags. Traffic, model part and gradient "
        "concatenations in fp32 gradient volumes (4 Ψ bytes).",
        "",
        "| program | non-GEMM traffic | of it in the model | minus the matching peer | "
        "gradient concatenations | peak GiB | compile s |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in res["rows"]:
        vs = f"{r['vs peer']:+.2f} ({r['peer']})" if "peer" in r else ""
        lines.append(
            f"| {r['program']} | {r['traffic']:.2f} | {r['model']:.2f} | {vs} | "
            f"{r['concat']:.2f} | {r['peak GiB']:.2f} | {r['compile s']:.0f} |"
        )
    return "\n".join(lines)


def result(quick: bool = False, plots: str | None = None, g: int = 1) -> dict[str, Any]:
    """:func:`run` plus its ``"markdown"`` (or ``"skipped"`` without the gpu-aot extra)."""
    mesh, why = H.h100_mesh(N)
    if mesh is None:
        return {"skipped": why, "markdown": f"Skipped: {why}.", "rows": []}
    res = run(quick, g)
    res["markdown"] = markdown(res)
    return res


def reading(res: dict[str, Any]) -> str:
    if not res.get("rows"):
        return ""
    rows = {r["program"]: r for r in res["rows"]}
    ours = [r for r in res["rows"] if "peer" in r and "spike" not in r["program"]]
    lines = []
    for r in ours:
        goal = 0.25 if not r["program"].startswith("jaxdp stage 3") else 0.0
        met = "met" if r["vs peer"] <= goal else "not met"
        lines.append(
            f"{r['program'][6:]}: {r['vs peer']:+.2f} against {r['peer']} (goal <= {goal:+.2f}: "
            f"{met})"
        )
    s3, sharded = rows.get("jaxdp stage 3"), rows.get("GSPMD sharded")
    peak = ""
    if s3 and sharded:
        ok = "met" if s3["peak GiB"] <= sharded["peak GiB"] else "not met"
        peak = H.reading(
            "bench_traffic", "peak", s3=s3["peak GiB"], sharded=sharded["peak GiB"], ok=ok
        )
    concat = [r["program"][6:] for r in ours if r["concat"] > 0]
    rep = rows.get("GSPMD replicated")
    text = H.reading(
        "bench_traffic",
        lines="; ".join(lines),
        peak_text=peak,
        concat=", ".join(concat) if concat else "none",
        pack=f"{rep['concat']:.2f}" if rep else "n/a",
    )
    bf16 = rows.get("jaxdp stage 1")
    plain, fused = (rows.get(f"jaxdp stage 1, fp32 wire{s}") for s in ("", " + fusion"))
    if bf16 and plain and fused:
        text += "\n" + H.reading(
            "bench_traffic",
            "fp32_wire",
            plain=plain["traffic"] - bf16["traffic"],
            fused=fused["traffic"] - bf16["traffic"],
        )
    if s0 := rows.get("jaxdp stage 0, fp32 wire"):
        text += "\n\n" + H.reading("bench_traffic", "stage0_wire", s0=s0["vs peer"])
    spikes = [
        (r["program"][6:].split(",")[0], r["traffic"] - rows[r["program"].split(",")[0]]["traffic"])
        for r in res["rows"]
        if "spike" in r["program"] and r["program"].split(",")[0] in rows
    ]
    if spikes:
        text += "\n\n" + H.reading(
            "bench_traffic",
            "spikes",
            costs="; ".join(f"{name} {d:+.2f}" for name, d in spikes),
        )
    remat = rows.get("GSPMD sharded + remat")
    if s3 and remat and sharded:
        text += "\n\n" + H.reading(
            "bench_traffic",
            "stage3_operands",
            s3=s3["traffic"],
            sharded=sharded["traffic"],
            peak=s3["peak GiB"],
        )
    return text


def main(argv: list[str]) -> None:
    g = int(argv[argv.index("--g") + 1]) if "--g" in argv else 1
    print(result("--quick" in argv, g=g)["markdown"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
