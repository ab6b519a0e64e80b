"""Gradient-accumulation fusion on one GPU, kernel by kernel (BENCHMARKS.md section 13).

``bench_fusion.py``'s MLP (8 ``jaxdp.nn.Dense`` 4096 x 4096, bf16, ``G = 8``), stage 0, at 2,048
and 8,192 rows per micro-batch: unfused, fused, fused as it was before ``3544347`` (the kernels
lifted to fp32 once, ahead of the micro-batch loop: ``before``), and both again with XLA's
Triton GEMM fusions off (``xla_gpu_enable_triton_gemm=False``). Per variant: ms/step (median of
7 rounds of 5 steps), compile seconds, temp bytes, the GEMM backends in the compiled program and
the 14 longest kernels by name from a profile of 3 steps (launches and ms per step,
``bench_gpu.busy_ms``).

Run on a GPU host (one JSON line per variant, also appended to ``$OUT/fusion_kernels.jsonl``
when ``OUT`` is set)::

    PYTHONPATH=. python bench/gpu_fusion_kernels.py

Check on a CPU: ``PYTHONPATH=. python bench/gpu_fusion_kernels.py --tiny``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import time
from typing import Any

import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H
import _models
import bench_gpu

from jaxdp import DataParallel, DDPConfig
from jaxdp._src.core import fusion as _fusion
from jaxdp._src.strategy import kernels as _kernels

G = 8
OPTIONS: dict[str, Any] = {
    "default": None,
    "before": None,
    "notriton": {"xla_gpu_enable_triton_gemm": False},
}
NEW_PREPARE = _kernels.Reduction.prepare


def before_prepare(self: Any, k: Any, params: Any, mb0: Any) -> Any:
    """The kernels lifted to fp32 once, ahead of the micro-batch loop (before ``3544347``)."""
    wv = k.ops.varying(k.source(params))
    lift, fused = _fusion.fused_function(k.parts, wv, mb0)
    return lift(wv), jax.value_and_grad(fused, has_aux=True), fused


def variant(width: int, depth: int, rows: int, options: str, fuse: bool) -> dict[str, Any]:
    loss_fn, params, data = _models.dense_mlp_problem(width, depth, rows * G)
    _kernels.Reduction.prepare = before_prepare if options == "before" else NEW_PREPARE
    cfg = DDPConfig(
        zero_stage=0,
        num_microbatches=G,
        param_dtype="bfloat16",
        grad_reduce_in_fp32=True,
        gradient_accumulation_fusion=fuse,
    )
    dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, compiler_options=OPTIONS[options])
    state, batch = dp.init(params), dp.shard_batch(data)
    t0 = time.perf_counter()
    compiled = dp.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    backends = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    backends.update(re.findall(r'"kind":"(__triton\w*)"', text))
    mem = compiled.memory_analysis()
    box = [state]

    def steps(k: int) -> Any:
        for _ in range(k):
            box[0], _ = dp.step(box[0], batch)
        return jax.block_until_ready(box[0])

    ms = 1e3 * H.median_time(steps, 7, inner=5, warmup=3)
    busy, state, kernels = bench_gpu.busy_ms(dp.step, box[0], batch, n=3)
    top = list(kernels.items())[:14]
    return {
        "rows": rows,
        "options": options,
        "fused": fuse,
        "ms": ms,
        "compile_s": round(compile_s, 2),
        "temp_gib": None if mem is None else mem.temp_size_in_bytes / 2**30,
        "backends": dict(backends),
        "busy_ms": busy,
        "top": [(k[:90], c, t) for k, (c, t) in top],
    }


def main(argv: list[str]) -> list[dict[str, Any]]:
    tiny = "--tiny" in argv
    width, depth = (256, 2) if tiny else (4096, 8)
    out = []
    for rows in [16] if tiny else [2048, 8192]:
        for options in OPTIONS:
            for fuse in (True,) if options == "before" else (False, True):
                try:
                    r = variant(width, depth, rows, options, fuse)
                except Exception as e:  # one variant's failure must not cost the others
                    r = {"rows": rows, "options": options, "fused": fuse, "error": repr(e)[:300]}
                finally:
                    _kernels.Reduction.prepare = NEW_PREPARE
                print(json.dumps(r), flush=True)
                if os.environ.get("OUT"):
                    with open(os.path.join(os.environ["OUT"], "fusion_kernels.jsonl"), "a") as f:
                        f.write(json.dumps(r) + "\n")
                out.append(r)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
