"""Run every benchmark in one process and write BENCHMARKS.md (GUIDE.md section 4).

Run from the repository root:  python bench/run_all.py [--out BENCHMARKS.md]

Runs every benchmark in bench/ (layout, step time, memory on CPU and on compile-only H100s,
communication, numerics vs N, compile time, scaling, gradient-accumulation fusion, traffic
against GSPMD peers) on 8 simulated CPU devices and writes their tables, plots (PNG, linked),
the command, the machine and the software versions into one Markdown file. About 20 minutes on
a 2-core machine;
``--quick`` runs everything at minimal size as a smoke test (a few minutes; CI runs it through
``tests/test_bench_smoke.py``) and writes to the temp folder unless ``--out`` is given.
"""

from __future__ import annotations

import os
import re
import sys

if "jax" not in sys.modules:  # must be set before jax starts its backend
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    # Simulated CPU devices by design; skip any installed GPU plugin (and its start-up errors).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import datetime
import io
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench_comm  # noqa: E402
import bench_compile  # noqa: E402
import bench_dispatch  # noqa: E402
import bench_fusion  # noqa: E402
import bench_layout  # noqa: E402
import bench_memory  # noqa: E402
import bench_memory_gpu  # noqa: E402
import bench_numerics  # noqa: E402
import bench_scaling  # noqa: E402
import bench_step  # noqa: E402
import bench_traffic  # noqa: E402
import bench_zero3  # noqa: E402
import jax  # noqa: E402
from _sections import splice_section  # noqa: E402
from readings import (  # noqa: E402
    comm_reading,
    compile_reading,
    dispatch_reading,
    memory_gpu_reading,
    numerics_reading,
    scaling_reading,
    traffic_reading,
)


class _Tee(io.StringIO):
    """Capture what a benchmark prints while still showing it."""

    def write(self, s: str) -> int:
        sys.__stdout__.write(s)
        sys.__stdout__.flush()
        return super().write(s)


def _run(fn: Any) -> tuple[Any, str, float]:
    buf = _Tee()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        out = fn()
    return out, buf.getvalue(), time.perf_counter() - t0


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> str:
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        return f"{kib / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        return "unknown"


def _source() -> str:
    """The commit measured, and whether jaxdp/ differed from it."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--", "jaxdp")
    return f"`{head}`" + (
        # each line is "XY path"; _git strips the output, and with it the first line's X
        f", with uncommitted changes in jaxdp/: "
        f"{', '.join(ln.split(maxsplit=1)[-1] for ln in dirty.splitlines())}"
        if dirty
        else ", jaxdp/ clean"
    )


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")


def machine() -> str:
    devs = jax.devices()
    rows = [
        ("Date (UTC)", _now()),
        ("Commit", _source()),
        ("CPU", f"{_cpu_model()}, nproc = {os.cpu_count()}"),
        ("Memory", _mem_gib()),
        ("OS / Python", f"{platform.platform()} / {platform.python_version()}"),
        (
            "Versions",
            ", ".join(
                f"{p} {version(p)}" for p in ("jax", "jaxlib", "flax", "optax", "numpy", "jaxdp")
            ),
        ),
        ("Devices", f"{len(devs)} x {devs[0].platform} ({devs[0].device_kind}), simulated"),
        ("XLA_FLAGS", f"`{os.environ.get('XLA_FLAGS', '')}`"),
        ("JAX_PLATFORMS", f"`{os.environ.get('JAX_PLATFORMS', '')}`"),
    ]
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def step_analysis(res: dict[str, Any]) -> str:
    rows = res["rows"]

    def ms(name: str) -> float:
        return next(v for k, v in rows.items() if k.startswith(name))[0]

    plain, ctrl, peer = ms("plain jit"), ms("control"), ms("shard_map per-leaf pmean")
    g4_0, g4_2 = ms("jaxdp stage 0, G=4"), ms("jaxdp zero_stage=2, G=4")
    small = ms("jaxdp stage 0, bucket_size")
    lo, hi = next(v for k, v in res["spread"].items() if k.startswith("jaxdp stage 0, bucket"))
    one = list(res["single_device"].values())
    default = ms("jaxdp default")
    return f"""\
**Reading the numbers.**

* *Why plain `jit` is slow here, and why the acceptance ratio flatters jaxdp.* Flax stores a
  kernel as `[in, out]`; the weight gradient comes out of its dot as `[out, in]` and is then
  transposed. In the `jit` program XLA's SPMD partitioner puts the all-reduce right after each
  weight-gradient dot, *before* that transpose, so the transpose can no longer be folded into the
  dot; XLA:CPU then fuses a strided transpose into every elementwise Adam fusion that reads the
  gradient (14 `transpose` ops in the compiled HLO). In the `shard_map` programs (jaxdp and the
  naive peer) the transpose happens before the collective and is folded away (0 transposes).
  The control row is the same network with kernels stored `[out, in]`: its plain `jit` program
  has no transpose and runs in {1e3 * ctrl:.1f} ms instead of {1e3 * plain:.1f} ms. Default
  jaxdp runs at {default / ctrl:.2f}x that control and {default / peer:.2f}x the naive per-leaf
  `pmean` peer (in seven runs while writing this benchmark: 0.95x to 1.15x of the control,
  about 5% slower than the peer on average; jaxdp also packs and unpacks the bucket and
  computes the global gradient norm every step). So on this backend jaxdp's gain over plain
  `jit` comes from where the collective sits, which any `shard_map` program gets, not from
  its bucketing. This explains the 0.56-0.65x that GUIDE.md §3 left unexplained.
* *Buckets on CPU.* With `bucket_size={bench_step.SMALL_BUCKET:,}` the layout has several
  buckets, but XLA:CPU's all-reduce combiner merges their collectives back into one (see the
  HLO column). On one device the several-bucket step costs {one[1] / one[0]:.2f}x the default
  one, so packing several buckets costs no measurable compute; on 8 simulated devices it is
  {small / default:.2f}x, with single steps from {1e3 * lo:.0f} to {1e3 * hi:.0f} ms. This row
  is bimodal on this machine: in repeated runs while writing this benchmark its median ranged
  from 1x to 5x of the default step (also with 4 simulated devices, never with 1), with the
  same single combined all-reduce, which points at the rendezvous of device threads
  oversubscribing 2 cores rather than at jaxdp's code. Treat it as noise
  here; GUIDE.md §3 saw the same kind of slowdown (2.2x). On a GPU the combine thresholds must be
  set from `bucket_size` for buckets to survive.
* *Micro-batches.* G=4 runs four matmuls of 8 rows per device instead of one of 32, which the
  CPU does less efficiently ({g4_0 / default:.2f}x the G=1 step at stage 0). ZeRO-2 with G=4
  reduce-scatters every micro-batch (each in the scan body: stage 2 peels no last micro-batch
  out of the loop, having no end-of-step reduction to overlap it with), and runs at
  {g4_2 / g4_0:.2f}x stage 0 with G=4 here: CPU collectives are memory copies between
  threads, so G reduce-scatters cost little.
* Absolute times and the overlap of communication with the backward pass are meaningless on
  simulated CPU devices (collectives are synchronous rendezvous); the GPU comparison is still
  to be made."""


def memory_analysis(res: dict[str, Any]) -> str:
    psi = res["psi"]
    ctl = {
        (r["param_dtype"], r["bucket_size"], r["stage"], r["g"]): r["temp"] / psi
        for r in res["controls"]
    }
    f32 = "float32 (None)"
    g4 = [r["temp"] / psi for r in res["rows"] if r["g"] > 1]
    small = f"{bench_memory.SMALL_BUCKET:,}"
    return f"""\
**Reading the numbers.**

* *Persistent state matches the formulas exactly* (ratio 1.000 in the breakdown): bf16 params
  2Ψ replicated, fp32 master and Adam m, v 12Ψ, divided by N from stage 1. Stage 2 keeps no
  gradient state between steps, so its state equals stage 1's.
* *Everything above the formula is transient (`temp`), and most of it is gradients.* At this
  size the default bucket ('auto' = 40M elements) holds the whole model, so each rank holds its
  per-leaf local gradients and the packed fp32 bucket at the same time, twice the full gradient.
  With several buckets XLA frees them bucket by bucket: with fp32 params the stage-1 temp goes
  from {ctl[(f32, "auto", 1, 1)]:.1f} to {ctl[(f32, small, 1, 1)]:.1f} B/Ψ, exactly the
  full-size fp32 accumulator of the "+4Ψ" column. On a model much larger than 40M params the
  default already gives many buckets, so this doubling is bounded by a bucket there; this
  benchmark is the worst case.
* *Stage 0* needs the packed bucket and the all-reduce's separate output buffer (8 B/Ψ with fp32
  params, with one bucket or several).
* *Stage 2 does not reach ZeRO-2's 2Ψ/N gradient term.* The sharded accumulator is 4Ψ/N, but
  every micro-batch still materialises its full local gradient before the reduce-scatter, so the
  temp stays at {ctl[(f32, small, 2, 4)]:.1f} B/Ψ with fp32 params and several buckets (4Ψ of it
  is the local gradient). Stage 2 saves only stage 1's full-size fp32 accumulator in the scan
  carry (compare G=4 rows for stages 1 and 2). DeepSpeed and Megatron reach 2Ψ/N because
  backward hooks reduce-scatter and free each bucket while the backward pass runs; in one XLA
  program that depends on the scheduler.
* *CPU-only inflation of the bf16 rows.* XLA:CPU has no bf16 dots or bf16 collectives: it
  converts the bf16 params to f32 for every dot (the "dots" column), and in the
  micro-batch loop these converted copies and their transposes are hoisted out as loop
  invariants and carried through the `while` loop (the "f32 carried" columns: more than the
  4Ψ bytes that are the params themselves in the fp32 control). It also runs the bf16
  reduce-scatter, all-reduce and all-gather in f32 (the collectives column; the engine's wire
  dtype is bf16).
  That is why the bf16 G=4 temps ({min(g4):.1f} to {max(g4):.1f} B/Ψ) exceed the fp32 ones
  ({ctl[(f32, "auto", 2, 4)]:.1f} B/Ψ at stage 2). A GPU compile (GUIDE.md §3, compile-only
  H100 devices) is needed for the real bf16 figures; it was not available here.
* Activations are negligible here (batch 8 rows per device)."""


GPU_SECTION = """\
No GPU was lent to the sessions that wrote this file, so nothing here ran on one. On a machine
with NVIDIA GPUs one command measures everything this section is for and replaces it (the
block between the `bench_gpu` markers; `run_all.py` keeps a measured block when it regenerates
the rest): bare `jit` against jaxdp at stages 0-3 x G in {1, 4} on a 303M-parameter
`jaxdp.models.GPT` (cuDNN flash attention, `nn.scan`), blocking and pipelined ms/step, device
busy time from a profile, compiled peak memory, first-call time, MFU, and the fused / unfused
`jaxdp.nn.Dense` MLP (`--tiny` checks it on a CPU):

```bash
python bench/bench_gpu.py --write BENCHMARKS.md
```

Until then the GPU evidence is structural: the sections above compile for 8 H100s without one
(memory, traffic, compile time) and `tests/test_aot.py` checks the compiled schedule (one
collective per bucket, overlap with backward GEMMs, wire dtypes)."""


def _gpu_block(path: str) -> str:
    """The measured GPU part of an existing ``path`` (kept: from the first ``bench_gpu`` start
    marker to the last ``bench_gpu...`` end marker, with any reading between its blocks), or the
    not-run text."""
    start = "<!-- bench_gpu:start -->"
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
        ends = list(re.finditer(r"<!-- bench_gpu[-\w]*:end -->", text))
        if start in text and ends and "No GPU was lent" not in text.split(start)[1]:
            return text[text.index(start) : ends[-1].end()]
    return f"{start}\n{GPU_SECTION}\n<!-- bench_gpu:end -->"


def _section(title: str, module: str, seconds: float, body: str) -> str:
    # The anchor is the link target for README.md and docs/: the heading's own slug carries the
    # seconds, so it changes with every run.
    return f'## {title}: `bench/{module}.py` ({seconds:.0f} s) <a id="{module}"></a>\n\n{body}'


def _section_with(
    title: str, module: str, reading: Callable[[dict[str, Any]], str] | None = None
) -> Callable[[dict[str, Any], float], str]:
    """A section's text from its results and seconds: heading, table and (if any) reading."""

    def section(res: dict[str, Any], seconds: float) -> str:
        body = _section(title, module, seconds, res["markdown"])
        return body if reading is None else f"{body}\n\n{reading(res)}"

    return section


step_section = _section_with("2. Step time", "bench_step", step_analysis)
memory_section = _section_with("3. Memory per device", "bench_memory", memory_analysis)
memory_gpu_section = _section_with(
    "4. Memory per device on 8 x H100, compile-only", "bench_memory_gpu", memory_gpu_reading
)
compile_section = _section_with(
    "7. Compile time vs parameter leaves", "bench_compile", compile_reading
)
zero3_section = _section_with("10. ZeRO-3 against GSPMD FSDP", "bench_zero3")
traffic_section = _section_with(
    "11. Traffic and peak against GSPMD peers", "bench_traffic", traffic_reading
)
dispatch_section = _section_with("12. Host time per step", "bench_dispatch", dispatch_reading)


# --only: section number, measurement (quick -> results), section text (results, seconds)
ALONE: dict[str, tuple[int, Any, Any]] = {
    "step": (
        2,
        lambda quick: bench_step.main(rounds=2, inner=1, warmup=1) if quick else bench_step.main(),
        step_section,
    ),
    "memory": (3, lambda quick: bench_memory.main(quick=quick), memory_section),
    "memory_gpu": (4, lambda quick: bench_memory_gpu.main(quick=quick), memory_gpu_section),
    "fusion": (
        9,
        lambda quick: bench_fusion.run(quick=quick),
        _section_with("9. Gradient-accumulation fusion", "bench_fusion"),
    ),
    "zero3": (10, lambda quick: bench_zero3.main(quick=quick), zero3_section),
    "compile": (7, lambda quick: bench_compile.main(quick=quick), compile_section),
    "traffic": (11, lambda quick: bench_traffic.main_result(quick=quick), traffic_section),
    "dispatch": (12, lambda quick: bench_dispatch.main_result(quick=quick), dispatch_section),
}


def measured_alone(cmd: str) -> str:
    """The provenance line of a section measured on its own (``--only``): its machine and
    commit need not be those of the Machine section."""
    return (
        f"*Measured alone by `{cmd}` at {_source()} on {_now()} UTC ({_cpu_model()}, nproc = "
        f"{os.cpu_count()}); the other sections are from the run in the Machine section, so "
        "compare seconds only within this section.*"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--out",
        default=None,
        help="output file (default: BENCHMARKS.md; with --quick a file in the temp folder)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: every benchmark at minimal size and rounds, no timing claims",
    )
    p.add_argument(
        "--plots", default=None, help="folder for the PNG plots (default: bench/, linked)"
    )
    p.add_argument(
        "--only",
        choices=sorted(ALONE),
        default=None,
        help="measure one section (step: 2, memory: 3, memory_gpu: 4, compile: 7, fusion: 9, "
        "zero3: 10, "
        "traffic: 11, dispatch: 12) and replace it in "
        "the existing --out file, with a line saying where and when (section 7 alone takes "
        "most of the whole run)",
    )
    args = p.parse_args(argv)
    quick = args.quick
    if args.out is None:
        args.out = (
            os.path.join(tempfile.gettempdir(), "jaxdp-BENCHMARKS-quick.md")
            if quick
            else os.path.join(ROOT, "BENCHMARKS.md")
        )
    if args.only is not None:
        number, measure, section = ALONE[args.only]
        res, _, seconds = _run(lambda: measure(quick))
        cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
        text = f"{section(res, seconds)}\n\n{measured_alone(cmd)}"
        splice_section(args.out, number, text)
        print(f"\nreplaced section {number} of {args.out} ({seconds:.0f} s)")
        return
    if quick and args.plots is None:
        args.plots = tempfile.mkdtemp(prefix="jaxdp-bench-plots-")
    if args.plots is not None:
        os.makedirs(args.plots, exist_ok=True)  # before minutes of benchmarks, not after
    t_start = time.perf_counter()

    if quick:
        layout, layout_log, t_layout = _run(lambda: bench_layout.main(n_leaves=100, repeats=2))
        step, _, t_step = _run(lambda: bench_step.main(rounds=2, inner=1, warmup=1))
    else:
        layout, layout_log, t_layout = _run(bench_layout.main)
        step, _, t_step = _run(bench_step.main)
    memory, _, t_memory = _run(lambda: bench_memory.main(quick=quick))
    gpu_memory, _, t_gpu = _run(lambda: bench_memory_gpu.main(quick=quick))
    comm, _, t_comm = _run(lambda: bench_comm.main(quick=quick))
    numerics, _, t_num = _run(lambda: bench_numerics.main(quick=quick, plots=args.plots))
    compile_, _, t_compile = _run(lambda: bench_compile.main(quick=quick))
    scaling, _, t_scaling = _run(lambda: bench_scaling.main(quick=quick, plots=args.plots))
    fusion, _, t_fusion = _run(lambda: bench_fusion.run(quick=quick))
    zero3, _, t_zero3 = _run(lambda: bench_zero3.main(quick=quick))
    traffic, _, t_traffic = _run(lambda: bench_traffic.main_result(quick=quick))
    dispatch, _, t_dispatch = _run(lambda: bench_dispatch.main_result(quick=quick))
    scal_md = scaling["markdown"]

    layout_md = "\n".join(
        [
            "| layout | median ms (7 runs) | target |",
            "|---|---:|---|",
            *(f"| {k} | {1e3 * v:.1f} | < 1000 ms |" for k, v in layout.items()),
        ]
    )
    layout_title = (
        "1. Bucket layout: `BucketLayout.from_params` on a 1,000-leaf pytree"
        f' ({t_layout:.1f} s) <a id="bench_layout"></a>'
    )
    total = time.perf_counter() - t_start
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    doc = f"""# jaxdp benchmarks

Generated by `{cmd}` (run from the repository root) in {total:.0f} s; do not edit by hand.
Method: GUIDE.md §4. Only ratios measured in the same process mean something on this machine.

## Machine

{machine()}

## {layout_title}

`bench/bench_layout.py`, dp=8, bucket_size=1,000,000.

{layout_md}

```
{layout_log.strip()}
```

{step_section(step, t_step)}

{memory_section(memory, t_memory)}

{memory_gpu_section(gpu_memory, t_gpu)}

{_section("5. Communication per step", "bench_comm", t_comm, comm["markdown"])}

{comm_reading(comm)}

{_section("6. Numerics vs N", "bench_numerics", t_num, numerics["markdown"])}

{numerics_reading(numerics)}

{compile_section(compile_, t_compile)}

{_section("8. Scaling vs device count and model size", "bench_scaling", t_scaling, scal_md)}

{scaling_reading(scaling)}

{_section("9. Gradient-accumulation fusion", "bench_fusion", t_fusion, fusion["markdown"])}

{zero3_section(zero3, t_zero3)}

{traffic_section(traffic, t_traffic)}

{dispatch_section(dispatch, t_dispatch)}

## 13. GPU: `bench/bench_gpu.py` <a id="bench_gpu"></a>

{_gpu_block(args.out)}
"""

    with open(args.out, "w") as f:
        f.write(doc)
    print(f"\nwrote {args.out} in {total:.0f} s")


if __name__ == "__main__":
    main()
