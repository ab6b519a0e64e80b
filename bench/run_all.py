"""Run every benchmark in one process and write BENCHMARKS.md (GUIDE.md section 4).

Run from the repository root:  python bench/run_all.py [--out BENCHMARKS.md]

Runs every benchmark in bench/ (layout, step time, memory on CPU and on compile-only H100s,
communication, numerics vs N, compile time, scaling, gradient-accumulation fusion, traffic
against GSPMD peers, cluster figures predicted from compiled programs, hierarchical data
parallelism, bfloat16 Adam moments) on 8 simulated CPU
devices and writes their tables, plots (PNG, linked),
readings (``bench/readings/*.md``, with this run's numbers put in), the command, the machine
and the software versions into one Markdown file. About 20 minutes on a 2-core machine;
``--quick`` runs everything at minimal size as a smoke test (a few minutes; the test suite runs
it through ``tests/test_bench_smoke.py``) and writes to the temp folder unless ``--out`` is
given.
"""

from __future__ import annotations

import os
import sys

import _harness as H

os.environ.update(H.cpu_devices(8))

import argparse
import importlib
import re
import tempfile
import time

# --only NAME: (section number, title, module). Every module has ``result(quick, plots)`` (its
# numbers and their "markdown") and may have ``reading(result)`` (the prose under the table).
SECTIONS: dict[str, tuple[int, str, str]] = {
    "layout": (1, "Bucket layout", "bench_layout"),
    "step": (2, "Step time", "bench_step"),
    "memory": (3, "Memory per device", "bench_memory"),
    "memory_gpu": (4, "Memory per device on 8 x H100, compile-only", "bench_memory_gpu"),
    "comm": (5, "Communication per step", "bench_comm"),
    "numerics": (6, "Numerics vs N", "bench_numerics"),
    "compile": (7, "Compile time vs parameter leaves", "bench_compile"),
    "scaling": (8, "Scaling vs device count and model size", "bench_scaling"),
    "fusion": (9, "Gradient-accumulation fusion", "bench_fusion"),
    "zero3": (10, "ZeRO-3 against GSPMD FSDP", "bench_zero3"),
    "traffic": (11, "Traffic and peak against GSPMD peers", "bench_traffic"),
    "dispatch": (12, "Host time per step", "bench_dispatch"),
    # after section 13 (the GPU's, kept from the file): predictions, not measurements
    "cluster": (14, "Planning figures for clusters (predicted)", "bench_cluster"),
    "hierarchical": (
        15,
        "Hierarchical data parallelism on 8 x H100, compile-only",
        "bench_hierarchical",
    ),
    "moments": (16, "Adam's moments in bfloat16", "bench_moments"),
    "meter": (17, "Exposed communication", "bench_meter"),
    "stage3": (18, "Stage 3 at one rank on one H100, compile-only", "bench_stage3"),
}
#: The GPU section's number: measured on a GPU by bench_gpu.py, kept by a CPU run.
GPU_SECTION = 13


def section(name: str, quick: bool, plots: str | None) -> str:
    """Measure section ``name`` and return its text: heading, tables and reading."""
    number, title, module = SECTIONS[name]
    bench = importlib.import_module(module)
    res, _, seconds = H.timed(lambda: bench.result(quick=quick, plots=plots))
    if name == "layout":  # its heading names the measured call; its seconds are short
        head = f"{title}: `BucketLayout.from_params` on a 1,000-leaf pytree ({seconds:.1f} s)"
    else:  # the anchor is the link target for README.md and docs/: the heading's slug varies
        head = f"{title}: `bench/{module}.py` ({seconds:.0f} s)"
    text = f'## {number}. {head} <a id="{module}"></a>\n\n{res["markdown"]}'
    return f"{text}\n\n{bench.reading(res)}" if hasattr(bench, "reading") else text


def gpu_block(path: str) -> str:
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
    return f"{start}\n{H.reading('bench_gpu')}\n<!-- bench_gpu:end -->"


def measured_alone(cmd: str) -> str:
    """The provenance line of a section measured on its own (``--only``): its machine and
    commit need not be those of the Machine section."""
    return (
        f"*Measured alone by `{cmd}` at {H.source()} on {H.now()} UTC ({H.cpu_model()}, nproc = "
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
        choices=sorted(SECTIONS),
        default=None,
        help="measure one section ("
        + ", ".join(f"{k}: {v[0]}" for k, v in SECTIONS.items())
        + ") and replace it in the existing --out file, with a line saying where and when "
        "(section 7 alone takes most of the whole run)",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (
            os.path.join(tempfile.gettempdir(), "jaxdp-BENCHMARKS-quick.md")
            if args.quick
            else os.path.join(H.ROOT, "BENCHMARKS.md")
        )
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], H.ROOT), *sys.argv[1:]])
    if args.only is not None:
        t0 = time.perf_counter()
        text = section(args.only, args.quick, args.plots)
        number = SECTIONS[args.only][0]
        # a section after the GPU's (13) that the file lacks yet is added at its end
        H.splice_section(args.out, number, f"{text}\n\n{measured_alone(cmd)}", append=number > 13)
        print(f"\nreplaced section {SECTIONS[args.only][0]} of {args.out} ", end="")
        print(f"({time.perf_counter() - t0:.0f} s)")
        return
    if args.quick and args.plots is None:
        args.plots = tempfile.mkdtemp(prefix="jaxdp-bench-plots-")
    if args.plots is not None:
        os.makedirs(args.plots, exist_ok=True)  # before minutes of benchmarks, not after
    t_start = time.perf_counter()
    texts = {name: section(name, args.quick, args.plots) for name in SECTIONS}
    before = "\n\n".join(t for n, t in texts.items() if SECTIONS[n][0] < GPU_SECTION)
    after = "".join(f"\n\n{t}" for n, t in texts.items() if SECTIONS[n][0] > GPU_SECTION)
    total = time.perf_counter() - t_start
    doc = f"""# jaxdp benchmarks

Generated by `{cmd}` (run from the repository root) in {total:.0f} s; do not edit by hand.
Method: GUIDE.md §4. Only ratios measured in the same process mean something on this machine.

## Machine

{H.machine()}

{before}

## {GPU_SECTION}. GPU: `bench/bench_gpu.py` <a id="bench_gpu"></a>

{gpu_block(args.out)}{after}
"""
    with open(args.out, "w") as f:
        f.write(doc)
    print(f"\nwrote {args.out} in {total:.0f} s")


if __name__ == "__main__":
    main()
