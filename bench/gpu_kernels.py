"""GPU kernels a step compiles to, without a GPU (BENCHMARKS.md section 13).

A jaxdp GPT (``jaxdp.models.GPT``, XLA's attention: cuDNN's does not compile without a GPU) is
compiled for ``--dp`` compile-only H100s (``jaxdp.aot``), the bare step beside it (plain
``jit`` of ``value_and_grad`` + AdamW on one device, bf16 params from an fp32 master, as
``bench_gpu.py``'s bare row, :func:`bench_gpu.bare_step`, on one rank's 8 sequences). Each
variant compiles in a fresh process with XLA's ``--xla_dump_to`` and
``--xla_gpu_dump_llvmir``, and reports:

* ``kernels``: GPU kernels in the PTX XLA emitted (``.entry`` functions), and the PTX bytes.
  XLA emits one kernel per distinct fusion, and a fusion repeated in every layer compiles
  once only when its arguments have the same alignment everywhere;
* ``align 16``: kernel arguments XLA could only assume 16-byte aligned (a buffer passed into
  the program; its own are 256-byte aligned);
* ``compile s``: CPU seconds of ``lower(...).compile()`` (one process each; this machine's
  noise is 10-20% between processes, the kernel counts do not move).

``--no-hold`` compiles the jaxdp steps without ``jaxdp._src.comm.order.hold`` (where a donated step
keeps the old params allocated until the gradient norm: ``Strategy.holds_params``);
``--clip`` sets the jaxdp steps' ``DDPConfig.clip_grad``, with which stage 3 holds at dp > 1
too.

Run: ``JAX_PLATFORMS=cpu python bench/gpu_kernels.py [--layers 12 --dp 1]``; one variant:
``--one VARIANT`` (``bare``, ``stage0`` ... ``stage3``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
import time
from typing import Any

import _harness as H

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _problem(layers: int, width: int, dp: int) -> tuple[Any, Any, Any]:
    import jax
    import jax.numpy as jnp

    from jaxdp.models import GPT, GPTConfig

    cfg = GPTConfig(
        layers=layers,
        width=width,
        heads=max(1, width // 64),
        context=1024,
        scan=False,
        attention="xla",
    )
    model = GPT(cfg)
    tokens = jnp.zeros((1, cfg.context), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
    batch = {"tokens": jax.ShapeDtypeStruct((8 * dp, cfg.context + 1), jnp.int32)}
    return model, params, batch


def compile_one(
    variant: str, layers: int, width: int, dp: int, hold: bool, clip: float | None = None
) -> float:
    """CPU seconds to lower and compile ``variant``'s step (this process)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import SingleDeviceSharding

    from jaxdp import DataParallel, DDPConfig, aot
    from jaxdp.models import next_byte_loss

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_gpu  # imported ahead of the clock

    model, params, batch = _problem(layers, width, dp)
    mesh = aot.h100_mesh(dp)

    def loss_fn(p: Any, b: Any) -> Any:
        return next_byte_loss(model, p, b)

    t = time.process_time()
    if variant == "bare":  # bench_gpu.py's bare step, on one compile-only H100
        opt, step = bench_gpu.bare_step(model)
        sh = SingleDeviceSharding(mesh.devices.flat[0])

        def f32(tree: Any) -> Any:
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=sh), tree
            )

        state = (f32(params), f32(jax.eval_shape(opt.init, params)))
        # one rank's share of the batch (8 sequences), so the shapes match the jaxdp steps'
        b = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // dp, *x.shape[1:]), x.dtype, sharding=sh),
            batch,
        )
        jax.jit(step, donate_argnums=0).lower(state, b).compile()
    else:
        cfg = DDPConfig(zero_stage=int(variant[-1]), param_dtype="bfloat16", clip_grad=clip)
        engine = DataParallel(loss_fn, optax.adamw(1e-4), cfg, mesh=mesh)
        if not hold:  # this process compiles one step: the step's hold made an identity
            import jaxdp._src.engine.engine

            jaxdp._src.engine.engine.hold = lambda x, keep, until: x
        aot.compile_step(engine, params, batch)
    return time.process_time() - t


def read_dump(folder: str) -> dict[str, int]:
    """Kernels, PTX bytes and 16-byte-aligned kernel arguments in an XLA dump folder."""
    text = ""
    for name in sorted(glob.glob(os.path.join(folder, "*.ptx"))):
        with open(name) as f:
            text += f.read()
    return {
        "kernels": len(re.findall(r"\.entry ", text)),
        "ptx_bytes": len(text.encode()),
        "align16": len(re.findall(r"\.ptr(?:\.global)? \.align 16\b", text)),
    }


def measure(
    variant: str, layers: int, width: int, dp: int, hold: bool, clip: float | None = None
) -> dict[str, Any]:
    """``variant`` compiled in a fresh process with XLA's dumps on."""
    with tempfile.TemporaryDirectory() as folder:
        flags = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={folder} --xla_gpu_dump_llvmir"
        cmd = [os.path.abspath(__file__), "--one", variant, "--layers", str(layers)]
        cmd += ["--width", str(width), "--dp", str(dp)]
        cmd += [] if hold else ["--no-hold"]
        cmd += ["--clip", str(clip)] if clip else []
        out = H.python(cmd, {"XLA_FLAGS": flags.strip()}, check=False)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            raise SystemExit(f"gpu_kernels: {variant} failed:\n{out.stderr[-3000:]}")
        res: dict[str, Any] = json.loads(line[-1][len("RESULT ") :])
        res.update(read_dump(folder))
    return res


def table(rows: list[dict[str, Any]]) -> str:
    bare = next((r for r in rows if r["variant"] == "bare"), None)
    out = [
        "| variant | kernels (vs bare) | PTX MB | align-16 args | compile s (vs bare) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        k = f"{r['kernels']}" + (f" ({r['kernels'] / bare['kernels']:.2f}x)" if bare else "")
        c = f"{r['compile_s']:.1f}" + (
            f" ({r['compile_s'] / bare['compile_s']:.2f}x)" if bare else ""
        )
        out.append(f"| {r['name']} | {k} | {r['ptx_bytes'] / 1e6:.2f} | {r['align16']} | {c} |")
    return "\n".join(out)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--dp", type=int, default=1, help="compile-only H100s on the data axis")
    ap.add_argument("--variants", default="bare,stage0,stage1,stage3")
    ap.add_argument(
        "--no-hold", action="store_true", help="jaxdp steps without jaxdp._src.comm.order.hold"
    )
    ap.add_argument("--both", action="store_true", help="each jaxdp step with and without hold")
    ap.add_argument("--clip", type=float, help="the jaxdp steps' DDPConfig.clip_grad")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        s = compile_one(args.one, args.layers, args.width, args.dp, not args.no_hold, args.clip)
        print("RESULT " + json.dumps({"compile_s": s}))
        return
    rows = []
    for v in args.variants.split(","):
        holds = [True, False] if args.both and v != "bare" else [not args.no_hold]
        for hold in holds:
            r = measure(v, args.layers, args.width, args.dp, hold, args.clip)
            name = (
                v
                if v == "bare" or (hold and not args.both)
                else f"{v}, {'held' if hold else 'not held'}"
            )
            r.update(variant=v, name=name)
            rows.append(r)
            print(json.dumps(r), flush=True)
    clip = f", clip_grad={args.clip}" if args.clip else ""
    print(
        f"\n{args.layers}-layer GPT of width {args.width}, {args.dp} compile-only H100(s){clip}:\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
