"""Fingerprints of the optimised step programs, to prove a refactor changes no program.

Compiles jaxdp's step for 8 compile-only H100s (the ``gpu-aot`` extra, no GPU needed) over
stages 0-3 x G in {1, 4} x the wire modes (bf16 wire, ``grad_reduce_in_fp32``,
``reduce_scatter_with_fp32_accumulation`` at stages 1-3, ``deterministic_reduction``), plus a
scanned stage-3 model and a 4 x 2 DP x TP mesh, strips the metadata (source locations move
with the code) and hashes the optimised HLO.
Only public names are used, so the same script runs on any revision::

    JAX_PLATFORMS=cpu python bench/hlo_fingerprint.py > before.txt
    # ... restructure ...
    JAX_PLATFORMS=cpu python bench/hlo_fingerprint.py > after.txt
    diff before.txt after.txt   # no output: every program is the same

``--dump DIR`` also writes each stripped program, to diff the two sides of a change.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import re
import sys
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdp import DataParallel, DDPConfig
from jaxdp.aot import compile_step, example_mlp, h100_topology

WIRES = {
    "bf16": {},
    "fp32grad": {"grad_reduce_in_fp32": True},
    "rsfp32": {"reduce_scatter_with_fp32_accumulation": True},
    "ordered": {"deterministic_reduction": True},
}
_METADATA = re.compile(r", metadata=\{[^{}]*\}")
_LINE_SUFFIX = re.compile(r"\s+$", re.M)


_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def strip(text: str) -> str:
    """The program without what a move of source files changes: metadata (op names, source
    files and lines), the module's tables of source locations, and trailing blanks."""
    lines, in_table = [], False
    for line in _LINE_SUFFIX.sub("", _METADATA.sub("", text)).split("\n"):
        if line in _TABLES:
            in_table = True
        elif in_table and not line[:1].isdigit():
            in_table = False
        if not in_table:
            lines.append(line)
    return "\n".join(lines)


def _scan_mlp(width: int = 256, layers: int = 4, batch: int = 64) -> tuple[Any, Any, Any]:
    f32 = jnp.float32
    params = {
        "inp": {"w": jax.ShapeDtypeStruct((width, width), f32)},
        "stack": {
            "w": jax.ShapeDtypeStruct((layers, width, width), f32),
            "b": jax.ShapeDtypeStruct((layers, width), f32),
        },
    }
    data = {
        "x": jax.ShapeDtypeStruct((batch, width), f32),
        "y": jax.ShapeDtypeStruct((batch, width), f32),
    }

    def loss_fn(p: Any, b: Any) -> jax.Array:
        h = b["x"].astype(p["inp"]["w"].dtype) @ p["inp"]["w"]

        def layer(h: jax.Array, q: Any) -> tuple[jax.Array, None]:
            return jnp.tanh(h @ q["w"] + q["b"]), None

        h, _ = jax.lax.scan(layer, h, p["stack"])
        return jnp.mean((h.astype(jnp.float32) - b["y"]) ** 2)

    return loss_fn, params, data


_TP_SPECS = {
    "up": P(None, "model"),
    "up_b": P("model"),
    "down": P("model", None),
    "down_b": P(),
}


def _tp_block(d: int = 128, f: int = 256, batch: int = 32) -> tuple[Any, Any, Any]:
    f32 = jnp.float32
    params = {
        "up": jax.ShapeDtypeStruct((d, f), f32),
        "up_b": jax.ShapeDtypeStruct((f,), f32),
        "down": jax.ShapeDtypeStruct((f, d), f32),
        "down_b": jax.ShapeDtypeStruct((d,), f32),
    }
    data = {"x": jax.ShapeDtypeStruct((batch, d), f32), "y": jax.ShapeDtypeStruct((batch, d), f32)}

    def loss_fn(p: Any, b: Any) -> jax.Array:
        x = b["x"].astype(p["up"].dtype)
        h = x + jnp.tanh(x @ p["up"] + p["up_b"]) @ p["down"] + p["down_b"]
        return jnp.mean((h.astype(jnp.float32) - b["y"]) ** 2)

    return loss_fn, params, data


def cases() -> Iterator[tuple[str, dict[str, Any], str]]:
    """``(name, DDPConfig keywords, model)`` of every program fingerprinted."""
    for stage in range(4):
        for g in (1, 4):
            for wire, extra in WIRES.items():
                if stage == 0 and wire == "rsfp32":
                    continue  # an all-reduce has no reduce-scatter to accumulate in fp32
                cfg = dict(zero_stage=stage, num_microbatches=g, param_dtype="bfloat16", **extra)
                yield f"s{stage}-G{g}-{wire}", cfg, "mlp"
    for g in (1, 4):
        cfg = dict(zero_stage=3, num_microbatches=g, param_dtype="bfloat16", scan_layers=True)
        yield f"s3-G{g}-scan", cfg, "scan"
    for stage in range(4):
        yield f"s{stage}-G1-tp", dict(zero_stage=stage), "tp"
    for stage in range(3):
        yield (
            f"s{stage}-G4-tp-bf16",
            dict(zero_stage=stage, num_microbatches=4, param_dtype="bfloat16"),
            "tp",
        )


def compile_case(cfg: dict[str, Any], model: str, devices: list[Any]) -> str:
    if model == "tp":
        mesh = Mesh(np.asarray(devices).reshape(4, 2), ("data", "model"))
        loss_fn, params, batch = _tp_block()
        dp = DataParallel(loss_fn, optax.adamw(1e-3), DDPConfig(**cfg), mesh=mesh)
        # abstract params carry no sharding: the first init reads the specs, compile reuses them
        jax.eval_shape(lambda p: dp.init(p, param_specs=_TP_SPECS), params)
    else:
        mesh = Mesh(np.asarray(devices), ("data",))
        loss_fn, params, batch = (
            _scan_mlp() if model == "scan" else example_mlp(layers=4, width=256, batch=64)
        )
        dp = DataParallel(loss_fn, optax.adamw(1e-3), DDPConfig(**cfg), mesh=mesh)
    return compile_step(dp, params, batch).as_text()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--dump", type=pathlib.Path, help="write each stripped program here")
    ap.add_argument("--only", default="", help="regex: fingerprint only the matching cases")
    args = ap.parse_args(argv)
    devices = h100_topology(8)
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    for name, cfg, model in cases():
        if not re.search(args.only, name):
            continue
        text = strip(compile_case(cfg, model, devices))
        if args.dump:
            (args.dump / f"{name}.hlo").write_text(text)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        print(f"{name:16s} {digest}  {len(text.splitlines())} lines", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
