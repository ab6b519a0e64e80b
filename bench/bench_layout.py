"""Time BucketLayout.from_params on a 1,000-leaf pytree (target: < 1 s).

Run: python bench/bench_layout.py
"""

from __future__ import annotations

import time
from typing import Any

import _harness as H
import jax
import jax.numpy as jnp

from jaxdp import BucketLayout, DDPConfig


def tree(n_leaves: int):
    shapes = [(256, 256), (256,), (64, 1024), (1024,)]
    return {
        f"layer_{i:04d}": jax.ShapeDtypeStruct(shapes[i % 4], jnp.bfloat16) for i in range(n_leaves)
    }


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    n_leaves, repeats = (100, 2) if quick else (1000, 7)
    params = tree(n_leaves)
    out, log = {}, []
    for kind in ("contiguous", "megatron", "interleaved"):
        cfg = DDPConfig(
            zero_stage=0 if kind == "contiguous" else 1,
            bucket_size=1_000_000,
            bucket_layout="megatron" if kind == "megatron" else "interleaved",
        )
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            lay = BucketLayout.from_params(params, cfg, dp_size=8)
            times.append(time.perf_counter() - t0)
        out[kind] = H.median(times)
        log.append(
            f"{kind:12s} {n_leaves} leaves -> {len(lay.buckets)} buckets: "
            f"median {1e3 * out[kind]:.1f} ms over {repeats} runs"
        )
        print(log[-1])
    rows = [(k, f"{1e3 * v:.1f}", "< 1000 ms") for k, v in out.items()]
    table = H.table(["layout", f"median ms ({repeats} runs)", "target"], rows, "lrl")
    md = f"`bench/bench_layout.py`, dp=8, bucket_size=1,000,000.\n\n{table}\n\n```\n"
    return {"times": out, "markdown": md + "\n".join(log) + "\n```"}


if __name__ == "__main__":
    result()
