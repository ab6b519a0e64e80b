"""``python -m jaxdp.aot``: compile a DataParallel step for 8 compile-only GPUs on a machine
without one and print its collective schedule.

Example (needs the ``gpu-aot`` extra)::

    python -m jaxdp.aot --stage 1 --grad-reduce-in-fp32
    python -m jaxdp.aot --stage 2 --microbatches 4 --fp32-accumulation
    python -m jaxdp.aot --config configs/zero1_bf16_fp32_reduce.yaml --xla-defaults
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxdp.aot",
        description="Compile a jaxdp DataParallel step of an MLP for N compile-only GPUs "
        "(no GPU needed) and print, per collective, its kind, wire dtype, size and the compute "
        "ops XLA scheduled between its start and its done.",
    )
    p.add_argument("--config", help="DDPConfig YAML file; the options below override it")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default 1)")
    p.add_argument("--bucket-size", type=int, help="elements per bucket (default: two layers)")
    p.add_argument("--microbatches", type=int, help="num_microbatches (default 1)")
    p.add_argument("--param-dtype", help="working param dtype (default bfloat16)")
    p.add_argument("--grad-reduce-in-fp32", action="store_true", default=None)
    p.add_argument(
        "--fp32-accumulation",
        action="store_true",
        default=None,
        help="reduce_scatter_with_fp32_accumulation (bf16 all-to-all + fp32 sum)",
    )
    p.add_argument(
        "--overlap-param-gather",
        action="store_true",
        default=None,
        help="overlap_param_gather (stages 1-2: gather the params in the forward pass)",
    )
    p.add_argument("--gpus", type=int, default=8, help="compile-only GPUs on the host (default 8)")
    p.add_argument("--layers", type=int, default=8, help="MLP depth (default 8)")
    p.add_argument("--width", type=int, default=512, help="MLP width (default 512)")
    p.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    p.add_argument(
        "--xla-defaults",
        action="store_true",
        help="compile with XLA's default flags instead of jaxdp.xla_compiler_options",
    )
    p.add_argument("--no-lhs", action="store_true", help="leave the latency-hiding scheduler off")
    p.add_argument("--hlo", metavar="PATH", help="also write the compiled program's text here")
    return p


def _config(args: argparse.Namespace) -> Any:
    from jaxdp import DDPConfig

    base = DDPConfig.from_yaml(args.config) if args.config else DDPConfig(zero_stage=1)
    changes: dict[str, Any] = {}
    if args.config is None:
        changes |= {
            "param_dtype": "bfloat16",
            "bucket_size": 2 * args.width * (args.width + 1),
        }
    for field, value in (
        ("zero_stage", args.stage),
        ("bucket_size", args.bucket_size),
        ("num_microbatches", args.microbatches),
        ("param_dtype", args.param_dtype),
        ("grad_reduce_in_fp32", args.grad_reduce_in_fp32),
        ("reduce_scatter_with_fp32_accumulation", args.fp32_accumulation),
        ("overlap_param_gather", args.overlap_param_gather),
    ):
        if value is not None:
            changes[field] = value
    return base.replace(**changes)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = _parser().parse_args(argv)
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        # Compile-only GPUs need no GPU backend; the CUDA plugin must not try to open one.
        jax.config.update("jax_platforms", "cpu")

    import optax
    from rich.console import Console
    from rich.markup import escape

    from jaxdp import DataParallel
    from jaxdp._src.platform.xla_flags import xla_compiler_options, xla_flags

    from ..aot import (
        collective_roles,
        compile_step,
        example_mlp,
        h100_mesh,
        memory_report,
        schedule_report,
    )

    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    try:
        config = _config(args)
        mesh = h100_mesh(args.gpus, axis=config.data_axis)
        loss_fn, params, batch = example_mlp(args.layers, args.width, args.batch)
        dp = DataParallel(loss_fn, optax.adamw(1e-3), config, mesh=mesh)
        lhs = not args.no_lhs
        opts = (
            None
            if args.xla_defaults
            else xla_compiler_options(config, dp_size=dp.dp, latency_hiding_scheduler=lhs)
        )
        compiled = compile_step(dp, params, batch, compiler_options=opts)
    except (ValueError, TypeError, ImportError, RuntimeError, NotImplementedError) as e:
        console.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    text = compiled.as_text()
    if args.hlo:
        with open(args.hlo, "w", encoding="utf-8") as f:
            f.write(text)
    report = schedule_report(text)
    roles = collective_roles(report, dp)
    title = (
        f"{args.layers}-layer MLP (width {args.width}), {args.gpus}x H100, stage "
        f"{config.zero_stage}, G={config.num_microbatches}, "
        f"{len(dp.layout.buckets)} buckets of {config.bucket_size} elements"
    )
    console.print(report.table(title=title, roles=roles))
    grads = [
        c
        for c, r in zip(report.collectives, roles, strict=True)
        if r in ("grad bucket", "grad group")
    ]
    overlapped = sum(c.backward_between > 0 for c in grads)
    console.print(
        f"gradient collectives in ENTRY: {len(grads)} for {len(dp.layout.buckets)} buckets; "
        f"{overlapped} overlap backward compute"
    )
    console.print(escape(str(memory_report(compiled, dp))))
    if args.xla_defaults:
        console.print("XLA flags: XLA's defaults")
    else:
        flags = xla_flags(config, dp_size=dp.dp, latency_hiding_scheduler=lhs)
        console.print("XLA flags (jaxdp.xla_flags):\n  " + "\n  ".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
