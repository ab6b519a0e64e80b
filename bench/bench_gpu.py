"""GPU benchmark: jaxdp at every ZeRO stage against the bare jitted step, in one command.

Meant for a machine with NVIDIA GPUs (nothing here needs one: ``--tiny`` runs a small model on
the CPU as a check of the script). Same process, same model (``jaxdp.models.GPT``, cuDNN flash
attention through ``jax.nn.dot_product_attention``), same per-device batch (sequences of
the main job's default corpus, the Python standard library's source):

* **bare**: ``jax.jit`` of value_and_grad + AdamW on one device, bf16 working params with an
  fp32 master copy (what jaxdp's ``param_dtype="bfloat16"`` keeps), no collectives;
* **jaxdp**: ``DataParallel`` at stages 0-3 x ``G`` in {1, 4} on all local devices,
  ``param_dtype="bfloat16"``, default buckets; XLA flags from :func:`jaxdp.apply_xla_flags`
  are set before jax starts;
* **fusion**: ``bench_fusion.py``'s MLP of 8 ``jaxdp.nn.Dense`` 4096x4096 (bf16, ``G = 8``)
  with ``gradient_accumulation_fusion`` off and on.

Per variant: the first call (trace + compile) in seconds; then, after a warm-up of at least 3
steps and 1 s, **blocking** ms/step (median, ``block_until_ready`` after every step);
**pipelined** ms/step (15 steps dispatched back to back, one block, median of rounds); **host
ms/call**: how long each of those pipelined calls takes to return (the host's dispatch work
per step); **device busy** ms/step (a
``jax.profiler`` trace of 5 pipelined steps read with ``jax.profiler.ProfileData``: the
union of the GPU streams' op intervals, divided by 5; the 40 longest kernels by name, launches
and ms per step, go to ``--jsonl`` only); **peak** memory of the compiled
program (arguments + outputs - aliased + temp, ``memory_analysis()``); and **MFU** =
``tokens/s x (6 N + 12 L T d) / (devices x peak)`` from the pipelined time.

``--bare-again`` times the first ``G``'s bare step once more after its jaxdp rows: the bare row
runs first in its process, and on an H200 it has measured 1.8-4.1% slower pipelined (and 12-20
ms slower blocking) in some processes than in others. Extra XLA options for every variant, bare
and jaxdp alike, go in ``XLA_FLAGS`` (e.g. ``--xla_gpu_enable_triton_gemm=false``); the
section's header names them.

``--main-job STEPS`` also runs the main job, ``jaxdp-train --config configs/gpt_300m_gpu.yaml``,
for STEPS steps in a process of its own and reports its steady tokens/s and MFU;
``--main-job-set KEY=VALUE`` (repeatable) is passed to its ``--set``, e.g.
``gradient_accumulation_fusion=true``; ``--main-job-profile N`` passes ``--profile N`` and
reports the exposed-communication meter of its traced steps (compute, collective and exposed
collective ms per step, host gap; docs/training.md), at the cost of those steps' speed.

The XLA flags of :func:`jaxdp.xla_flags` are tried in a child process first: a jaxlib newer
than jaxdp's flag table may have dropped one, and XLA aborts on an unknown flag; any it refuses
is left out and named in the output. ``--budget-s`` is counted from the process's start
(imports and that probe included) and starts no variant that would end after it, judging by how
long the variant before it took (the first always runs; the ones left are named as skipped):
give it the bare row's time plus each variant's you want. Every finished variant is written at
once (``--write``, ``--jsonl``), so a run cut short keeps what it measured.

Run on a GPU host (the default model is the 303M-parameter GPT of ``configs/gpt_300m_gpu.yaml``)::

    python bench/bench_gpu.py --write BENCHMARKS.md --main-job 40   # replaces the GPU section

Check on a CPU: ``python bench/bench_gpu.py --tiny``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import _harness as H


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
    p.add_argument(
        "--fusion-rows", default="8192,2048", help="rows per micro-batch of the fusion MLP"
    )
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to run, e.g. 1,3")
    p.add_argument("--accum", default="1,4", help="micro-batch counts G to run, e.g. 4")
    p.add_argument(
        "--remat",
        default="gemm",
        help="stage 3's DDPConfig.remat_policy values to run, e.g. gemm,dots (one row each)",
    )
    p.add_argument("--write", default=None, help="replace this BENCHMARKS.md's GPU section")
    p.add_argument("--tiny", action="store_true", help="small model on the CPU (script check)")
    p.add_argument(
        "--unrolled", action="store_true", help="the blocks unrolled (GPTConfig.scan=False)"
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=("auto", "cudnn", "xla"),
        help="GPTConfig.attention: 'xla' measures stage 3 keeping XLA attention's dot operands",
    )
    p.add_argument("--block", default="", help="write between <!-- bench_gpu{BLOCK}:start -->")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds from the process's start: start no variant that would end after this, "
        "judging by the one before it",
    )
    p.add_argument(
        "--bare-again",
        action="store_true",
        help="time the first G's bare step again after its jaxdp variants (the first variant of "
        "a process has measured slow: a check on the ratios)",
    )
    p.add_argument("--jsonl", default=None, help="append each finished variant here")
    p.add_argument(
        "--main-job", type=int, default=0, metavar="STEPS", help="run jaxdp-train this long"
    )
    p.add_argument("--main-job-timeout", type=float, default=180.0, help="seconds")
    p.add_argument(
        "--main-job-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to jaxdp-train's --set, e.g. gradient_accumulation_fusion=true (repeatable)",
    )
    p.add_argument(
        "--main-job-profile",
        type=int,
        default=0,
        metavar="N",
        help="pass --profile N to the main job and report its exposed-communication meter",
    )
    p.add_argument("--dump-hlo", default=None, help="write the fusion MLP's compiled programs here")
    return p.parse_args(argv)


def checked_flags(base: list[str], flags: list[str]) -> tuple[list[str], list[str]]:
    """The ``flags`` a child process with ``base`` and them in ``XLA_FLAGS`` starts its backend
    with, and the ones it aborts on (tried one by one only when the whole set fails)."""

    def starts(extra: list[str]) -> bool:
        code, flags = "import jax; jax.devices()", " ".join([*base, *extra])
        try:
            run = H.python(["-c", code], {"XLA_FLAGS": flags}, timeout=60)
        except subprocess.TimeoutExpired:
            return False
        return run.returncode == 0

    if starts(flags):
        return flags, []
    kept = [f for f in flags if starts([f])]
    return kept, [f for f in flags if f not in kept]


ARGS = parse_args() if __name__ == "__main__" else None
FLAGS: tuple[list[str], list[str]] = ([], [])
#: The caller's own XLA_FLAGS (e.g. ``--xla_gpu_enable_triton_gemm=false``): every variant runs
#: with them, bare and jaxdp alike, and the section's header names them.
USER_FLAGS: list[str] = os.environ.get("XLA_FLAGS", "").split()
if ARGS is not None and "jax" not in sys.modules:
    if ARGS.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        import jaxdp as _jaxdp

        # The combine thresholds follow the default bucket size; set before jax starts.
        _mine = os.environ.get("XLA_FLAGS", "").split()
        # apply_xla_flags leaves the user's own flags in place and returns what it added; of
        # those, only the ones a child process starts with are kept.
        _added = _jaxdp.apply_xla_flags(_jaxdp.DDPConfig(zero_stage=1, param_dtype="bfloat16"))
        FLAGS = checked_flags(_mine, _added)
        os.environ["XLA_FLAGS"] = " ".join([*_mine, *FLAGS[0]])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp import aot  # noqa: E402
from jaxdp._src.platform.xla_flags import engine_compiler_options  # noqa: E402
from jaxdp.models import GPT, GPTConfig, attention_implementation, next_byte_loss  # noqa: E402
from jaxdp.train._data import CorpusError, batch_rows, load_corpus  # noqa: E402
from jaxdp.train._mfu import peak_tflops, train_flops_per_token  # noqa: E402

PIPELINE = 15
#: Kernels by name recorded per variant (``--jsonl``; not in the markdown): what the busy
#: time is made of, to set a jaxdp row's kernels against the bare row's.
KERNELS = 40


def busy_ms(
    step: Any, state: Any, batch: Any, n: int = 5
) -> tuple[float | None, Any, dict[str, list[float]]]:
    """Device busy time per step from a profile: the union of the GPU op intervals; and the
    kernel time by name (launches and ms per step), the longest first."""
    with tempfile.TemporaryDirectory(prefix="jaxdp-prof-") as folder:  # removed after reading
        with jax.profiler.trace(folder):
            for _ in range(n):
                state, m = step(state, batch)
            jax.block_until_ready((state, m))
        files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return None, state, {}
        from jax.profiler import ProfileData

        planes = ProfileData.from_file(files[0]).planes
    spans = []
    by_name: dict[str, list[float]] = {}
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            for e in line.events:
                spans.append((e.start_ns, e.start_ns + e.duration_ns))
                k = by_name.setdefault(e.name, [0.0, 0.0])
                k[0] += 1 / n
                k[1] += e.duration_ns / 1e6 / n
    if not spans:
        return None, state, {}
    spans.sort()
    total, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            total, lo, hi = total + hi - lo, a, b
        else:
            hi = max(hi, b)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:KERNELS]
    return (total + hi - lo) / 1e6 / n, state, {k: [round(c, 2), round(t, 4)] for k, (c, t) in top}


def measure(step: Any, compiled: Any, state: Any, batch: Any, steps: int) -> dict[str, Any]:
    """Blocking and pipelined ms/step, device busy ms/step and compiled peak bytes."""
    # Warm-up (compiled already): at least 3 steps and 1 s. The first variant of a process
    # otherwise times its first steps on a cold device (clocks ramping, first allocations):
    # an H200's bare row measured 51-52 ms blocking against 40-41 ms pipelined that way.
    t0, warm = time.perf_counter(), 0
    while warm < 3 or time.perf_counter() - t0 < 1.0:
        state, m = step(state, batch)
        jax.block_until_ready(m)
        warm += 1
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
    try:
        busy, state, kernels = busy_ms(step, state, batch)
    except Exception as e:  # a profiler that cannot start must not cost the other numbers
        print(f"profile failed: {type(e).__name__}: {e}", flush=True)
        busy, kernels = None, {}
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
        "kernels": kernels,
        "peak_gib": None if peak is None else peak / 2**30,
    }


def bare(
    model: GPT, params: Any, batch: Any, steps: int, g: int = 1, compiles: int = 2
) -> dict[str, Any]:
    """Single device, no collectives: bf16 working params, fp32 master, AdamW, the loss and the
    gradient norm returned (what jaxdp's ``metrics`` hold); with ``g > 1``
    the ``g`` micro-batches' gradients summed in fp32 in a ``lax.scan`` (what jaxdp's
    ``num_microbatches`` does, minus the reduction). Compiled twice: ``cold_compile_s`` pays
    the process's first cuBLAS / cuDNN autotuning, ``compile_s`` (the second) is what the
    engines, compiled after it, are held to."""
    opt, step = bare_step(model, g)
    dev = jax.devices()[0]
    master = jax.tree.map(lambda x: jnp.array(x, copy=True), jax.device_put(params, dev))
    state = (master, opt.init(master))
    batch = jax.device_put(batch, dev)
    out: dict[str, Any] = {}
    for key in ("cold_compile_s", "compile_s")[-compiles:]:
        jitted = jax.jit(lambda s, b: step(s, b), donate_argnums=0)  # a new cache entry each
        t0 = time.perf_counter()
        compiled = jitted.lower(state, batch).compile()
        out[key] = time.perf_counter() - t0
    return {**out, **measure(compiled, compiled, state, batch, steps)}


def bare_step(model: GPT, g: int = 1) -> tuple[Any, Any]:
    """``(optimizer, step)`` of :func:`bare`: ``step((master, opt_state), batch) -> (state,
    (loss, grad_norm))``, not jitted (``bench/gpu_kernels.py`` compiles it deviceless)."""
    opt = optax.adamw(1e-4)

    def grads_of(work: Any, tokens: Any) -> Any:
        loss, grads = jax.value_and_grad(lambda p: next_byte_loss(model, p, {"tokens": tokens}))(
            work
        )
        return loss, jax.tree.map(lambda x: x.astype(jnp.float32), grads)

    def step(state: Any, batch: Any) -> Any:
        master, opt_state = state
        work = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
        if g == 1:
            loss, grads = grads_of(work, batch["tokens"])
        else:
            tokens = batch["tokens"].reshape(g, -1, batch["tokens"].shape[-1])

            def body(acc: Any, tok: Any) -> Any:
                loss, grads = grads_of(work, tok)
                return (jax.tree.map(jnp.add, acc[0], grads), acc[1] + loss), None

            zero = (jax.tree.map(jnp.zeros_like, master), jnp.float32(0))
            (grads, loss), _ = jax.lax.scan(body, zero, tokens)
            grads, loss = jax.tree.map(lambda x: x / g, grads), loss / g
        updates, opt_state = opt.update(grads, opt_state, master)
        # The gradient norm too: jaxdp's metrics always carry it (one more read of the grads).
        return (optax.apply_updates(master, updates), opt_state), (loss, optax.global_norm(grads))

    return opt, step


def engine(
    model: GPT,
    params: Any,
    batch: Any,
    steps: int,
    stage: int,
    g: int,
    compiles: int = 2,
    remat: str = "gemm",
) -> dict[str, Any]:
    """``DataParallel`` at ``stage`` x ``g``. Compiled like the bare step: ``cold_compile_s``
    is this variant's first compile in the process (which pays the GPU autotuning of any GEMM
    fusion no earlier program had), ``compile_s`` a second one, by a fresh engine, which is
    what is held to the bare step's second compile. ``remat`` is stage 3's ``remat_policy``."""
    cfg = jaxdp.DDPConfig(zero_stage=stage, num_microbatches=g, param_dtype="bfloat16")
    if stage == 3:
        cfg = dataclasses.replace(cfg, remat_policy=remat)  # type: ignore[arg-type]

    def new_engine() -> Any:
        return jaxdp.DataParallel(lambda p, b: next_byte_loss(model, p, b), optax.adamw(1e-4), cfg)

    dp = new_engine()
    state = dp.init(params, example_batch=batch)
    b = dp.shard_batch(batch)
    out: dict[str, Any] = {}
    options = config_options(cfg)
    compiled = None
    for key in ("cold_compile_s", "compile_s")[-compiles:]:
        eng = dp
        if compiled is not None:  # a new engine: nothing of the first trace or compile cached
            eng = new_engine()
            aot.abstract_state(eng, params, batch)  # builds its layout, allocates nothing
        t0 = time.perf_counter()
        c = eng.step.lower(state, b).compile(compiler_options=options or None)
        out[key] = time.perf_counter() - t0
        compiled = compiled or c
    return {**out, **measure(compiled, compiled, state, b, steps)}


def config_options(cfg: Any) -> dict[str, Any]:
    """What :func:`jaxdp.xla_compiler_options` sets for ``cfg`` that ``XLA_FLAGS`` does not
    name already (the user's flags and a stage-1 config's, set at start-up) and that did not
    abort a backend there: per-executable options, so that each variant compiles as a user
    who applied its own config's flags would (e.g. stage 3 with micro-batches: XLA's
    analytical cost model). Nothing where no flags were applied (``--tiny``)."""
    if not FLAGS[0]:
        return {}
    dropped = {f.split("=", 1)[0].removeprefix("--") for f in FLAGS[1]}
    dev = jax.devices()[0]
    with warnings.catch_warnings():  # a jaxlib newer than the table: warned once at start-up
        warnings.simplefilter("ignore")
        # DataParallel(compiler_options="jaxdp")'s own resolution: less what XLA_FLAGS names
        mine = engine_compiler_options(
            "jaxdp", cfg, dp_size=jax.device_count(), platform=dev.platform, device=dev
        )
    return {k: v for k, v in (mine or {}).items() if k not in dropped}


def fusion(
    tiny: bool, steps: int, rows: int = 8192, dump: str | None = None
) -> list[dict[str, Any]]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_fusion

    width, depth, rows = (256, 2, 16) if tiny else (4096, 8, rows)
    g = 8
    out = bench_fusion.step_times(
        width, depth, rows * jax.device_count() * g, g, (0, 1), rounds=steps, inner=5, dump=dump
    )
    return [{**r, "rows": rows} for r in out]


MAIN_CONFIG = "configs/gpt_300m_gpu.yaml"


def main_job(
    steps: int,
    config: str = MAIN_CONFIG,
    timeout: float = 180.0,
    sets: tuple[str, ...] = (),
    profile: int = 0,
) -> dict[str, Any]:
    """``jaxdp-train --config configs/gpt_300m_gpu.yaml`` for ``steps`` steps in a child process
    (its own XLA flags, its default corpus; ``sets``: more of its ``--set KEY=VALUE``;
    ``profile``: its ``--profile N``, 0 for none): the summary it writes, or why there is none."""
    meta = {"steps": steps, "config": config, "sets": list(sets), "profile": profile}
    out = tempfile.mkdtemp(prefix="jaxdp-main-job-")
    cmd = [
        "-m", "jaxdp.train", "--config", config, "--steps", str(steps),
        "--out", out, "--overwrite", "--set", "train.sample_bytes=0", "--set",
        "train.eval_batches=1", "--set", f"train.log_every={max(steps // 4, 1)}",
    ]  # fmt: skip
    for kv in sets:
        cmd += ["--set", kv]
    if profile:
        cmd += ["--profile", str(profile)]
    path = os.pathsep.join([H.ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    # XLA_FLAGS passes on: the main job runs with the flags the bench checked and uses.
    t0 = time.perf_counter()
    try:
        run = H.python(cmd, {"PYTHONPATH": path}, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", **meta}
    summary = os.path.join(out, "summary.json")
    if run.returncode != 0 or not os.path.exists(summary):
        tail = (run.stdout + run.stderr)[-2000:]
        return {"error": f"exit {run.returncode}: {tail}", **meta}
    with open(summary) as f:
        info = json.load(f)
    info.pop("sample", None)
    return {**info, **meta, "process_s": time.perf_counter() - t0}


def text_corpus(context: int) -> tuple[np.ndarray, str]:
    """The main job's default corpus (the Python standard library's source) as bytes, and how
    to name it. Real text, not uniform random bytes: some costs depend on the token values
    (an embedding gradient that scatters into repeated rows took 20 ms a micro-batch on an
    H200 with text, 0.4 ms with random bytes)."""
    try:
        corpus = load_corpus(None, context)
    except CorpusError as e:  # no readable standard library: random bytes, and say so
        print(f"no text corpus ({e}); uniform random bytes instead", flush=True)
        return np.random.default_rng(0).integers(0, 256, 1 << 20).astype(np.uint8), "random bytes"
    return corpus.train, "text (the Python standard library)"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


Row = tuple[str, dict[str, Any], int, int]  # name, numbers, devices, micro-batches G


def markdown(
    head: str,
    rows: list[Row],
    fuse: list[dict[str, Any]] | None,
    mfu: Any,
    job: dict[str, Any] | None = None,
    skipped: list[str] | None = None,
    failed: list[str] | None = None,
) -> str:
    """The GPU section: each jaxdp row held to the bare row of the same ``G``."""
    bases: dict[int, dict[str, Any]] = {}
    for name, r, _, g in rows:
        if name.startswith("bare"):
            bases.setdefault(g, r)  # the first bare row of each G (not the unrolled one)
    lines = [
        head,
        "",
        "| variant | blocking ms | pipelined ms | vs bare (pipelined) | device busy ms | "
        "host ms/call | host vs bare | compile s | compile vs bare | peak GiB | MFU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r, devices, g in rows:
        base = bases.get(g)

        def vs(key: str, fmt: str, base: Any = base, r: dict[str, Any] = r) -> str:
            return "-" if base is None else format(r[key] / base[key], fmt) + "x"

        util = mfu(r["pipelined_ms"], devices)
        cold = f" (first: {r['cold_compile_s']:.1f})" if "cold_compile_s" in r else ""
        lines.append(
            f"| {name} | {r['blocking_ms']:.1f} | {r['pipelined_ms']:.1f} | "
            f"{vs('pipelined_ms', '.3f')} | {_f(r['busy_ms'], '.1f')} | "
            f"{r['host_ms']:.2f} | {vs('host_ms', '.2f')} | "
            f"{r['compile_s']:.1f}{cold} | {vs('compile_s', '.2f')} | "
            f"{_f(r['peak_gib'], '.2f')} | {_f(util, '.1%')} |"
        )
    if skipped:
        lines += ["", f"Not run (out of `--budget-s`): {', '.join(skipped)}."]
    if failed:
        lines += ["", f"Failed: {'; '.join(failed)}."]
    if fuse:
        lines += [
            "",
            "| fusion (8 x jaxdp.nn.Dense 4096 x 4096, bf16, G = 8) | rows per micro-batch | "
            "ms/step | fused vs unfused | compile s |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in fuse:
            ref = next(
                (
                    u["ms"]
                    for u in fuse
                    if u["stage"] == r["stage"] and u["rows"] == r["rows"] and not u["fused"]
                ),
                None,
            )
            speed = "-" if ref is None or not r["fused"] else f"{ref / r['ms']:.3f}x faster"
            lines.append(
                f"| stage {r['stage']}, fused={r['fused']} | {r['rows']} | {r['ms']:.2f} | "
                f"{speed} | {r['compile_s']:.1f} |"
            )
    if job is not None:
        sets = "".join(f" --set {kv}" for kv in job.get("sets", []))
        sets += f" --profile {job['profile']}" if job.get("profile") else ""
        lines += [
            "",
            f"Main job: `jaxdp-train --config {job['config']} --steps {job['steps']}{sets}`",
        ]
        if "error" in job:
            lines.append(f"failed: {job['error'][-500:]!r}")
        else:
            lines += [
                "",
                "| devices | ZeRO stage | G | first step s | step s | tokens/s | MFU |",
                "|---|---:|---:|---:|---:|---:|---:|",
                f"| {job['devices']} | {job['zero_stage']} | {job['num_microbatches']} | "
                f"{job['compile_s']:.1f} | {job['step_time_s']:.3f} | "
                f"{job['tokens_per_s']:,.0f} | {_f(job['mfu'], '.1%')} |",
            ]
            meter = job.get("exposed_communication")
            if meter:  # --profile: medians of the traced steps (jaxdp/train/_meter.py)
                lines += [
                    "",
                    f"Exposed communication (`--profile`, median of {meter['steps']} traced "
                    f"steps): collectives {meter['collective_ms']:.2f} ms/step, exposed "
                    f"{meter['exposed_ms']:.2f} ms ({meter['overlapped']:.0%} overlapped), "
                    f"compute {meter['compute_ms']:.2f} ms, host gap "
                    f"{meter['host_gap_ms']:.2f} ms, step {meter['wall_ms']:.2f} ms on the "
                    "device.",
                ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv) if argv is not None else ARGS
    assert args is not None
    t_start = time.perf_counter()
    if args.tiny:
        args.layers, args.width, args.heads, args.context, args.steps = 2, 64, 4, 32, 2
        args.batch_per_device = 4
    job: dict[str, Any] | None = None
    if args.main_job:  # first: this process's backend would hold most of the GPU's memory
        config = "configs/gpt_tiny.yaml" if args.tiny else MAIN_CONFIG
        job = main_job(
            args.main_job,
            config,
            args.main_job_timeout,
            tuple(args.main_job_set),
            args.main_job_profile,
        )
        print("main job", job, flush=True)
    n = jax.device_count()
    cfg = GPTConfig(
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        context=args.context,
        scan=not args.unrolled,
        attention=args.attention,
    )
    model = GPT(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, cfg.context), jnp.int32))["params"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    text, data = text_corpus(cfg.context)

    def tokens(rows: int) -> dict[str, Any]:
        return {"tokens": batch_rows(text, 0, 1, rows, cfg.context, slice(0, rows))}

    bpd = args.batch_per_device
    dev = jax.devices()[0]
    peak = args.peak_tflops or peak_tflops(dev.device_kind)
    per_token = train_flops_per_token(cfg, n_params)

    def mfu(ms: float, devices: int) -> float | None:
        if peak is None:
            return None
        return bpd * devices * cfg.context / (ms / 1e3) * per_token / (devices * peak * 1e12)

    kept, dropped = FLAGS
    attention = attention_implementation(cfg.attention, jnp.bfloat16, cfg.width // cfg.heads)
    head = (
        f"{n} x {dev.device_kind} ({dev.platform}), jax {jax.__version__}; GPT "
        f"{n_params / 1e6:.1f}M params ({cfg.layers} x {cfg.width}, {cfg.heads} heads, context "
        f"{cfg.context}, {'nn.scan' if cfg.scan else 'unrolled'}, {attention} attention), "
        f"{bpd} sequences per device per step of {data}, bf16 working params, "
        f"fp32 master, AdamW; MFU against {_f(peak, '.0f')} TFLOP/s per device. XLA flags: "
        f"{' '.join(kept) if kept else 'none'}"
        + (f"; the caller's own: {' '.join(USER_FLAGS)}" if USER_FLAGS else "")
        + (f"; refused by this jaxlib, left out: {' '.join(dropped)}" if dropped else "")
        + "."
    )
    print(head, flush=True)
    stages = [int(s) for s in args.stages.split(",")]
    accum = [int(a) for a in args.accum.split(",")]
    remats = args.remat.split(",")

    def variants(g: int) -> list[tuple[str, Any]]:
        """Each stage at ``g``; stage 3 once per ``--remat`` policy."""
        return [("engine", (s, g, r)) for s in stages for r in (remats if s == 3 else ["gemm"])]

    fusion_rows = [] if args.no_fusion else [int(r) for r in args.fusion_rows.split(",")]
    fusion_rows = fusion_rows[:1] if args.tiny else fusion_rows  # --tiny has one shape
    # The first G (bare, then each stage), the fusion MLP, then the other G: a run cut short
    # keeps the main comparison.
    plan: list[tuple[str, Any]] = [("bare", accum[0])]
    plan += variants(accum[0])
    plan += [("bare", accum[0])] if args.bare_again else []
    plan += [("fusion", r) for r in fusion_rows]
    for g in accum[1:]:
        plan += [("bare", g), *variants(g)]
    # The scanned blocks' loop against the same step with them unrolled.
    plan += [] if args.unrolled else [("unrolled", accum[0])]

    def remat_note(what: tuple[int, int, str]) -> str:
        """Names stage 3's policy when the run measures more than the default."""
        return f", remat {what[2]!r}" if what[0] == 3 and remats != ["gemm"] else ""

    rows: list[Row] = []
    fuse: list[dict[str, Any]] | None = None
    skipped: list[str] = []
    failed: list[str] = []
    last = 0.0

    def record(name: str, r: Any) -> None:
        print(name, r, flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                line = {"variant": name, "result": r, "at_s": time.perf_counter() - t_start}
                f.write(json.dumps(line) + "\n")
        if args.write and rows:
            md = markdown(head, rows, fuse, mfu, job, skipped, failed)
            H.write_block(args.write, md, args.block)

    for kind, what in plan:
        label = {
            "bare": f"bare, G = {what}",
            "fusion": f"fusion MLP, {what} rows",
            "engine": (
                f"stage {what[0]}, G = {what[1]}{remat_note(what)}" if kind == "engine" else ""
            ),
            "unrolled": f"bare, G = {what}, blocks unrolled",
        }[kind]
        elapsed = time.perf_counter() - t_start
        if rows and args.budget_s is not None and elapsed + last > args.budget_s:
            print(
                f"skipping {label}: {elapsed:.0f} s used + {last:.0f} s (the last variant) > "
                f"--budget-s {args.budget_s:.0f}",
                flush=True,
            )
            skipped.append(label)
            continue
        t0 = time.perf_counter()
        try:
            if kind == "bare":
                r = bare(model, params, tokens(bpd), args.steps, what, 1 if args.tiny else 2)
                again = any(row[0] == f"bare jit, 1 device, G = {what}" for row in rows)
                rows.append(
                    (f"bare jit, 1 device, G = {what}{', again' if again else ''}", r, 1, what)
                )
                record(rows[-1][0], r)
            elif kind == "engine":
                stage, g, remat = what
                r = engine(
                    model,
                    params,
                    tokens(bpd * n),
                    args.steps,
                    stage,
                    g,
                    1 if args.tiny else 2,
                    remat,
                )
                name = f"jaxdp stage {stage}, G = {g}, {n} devices{remat_note(what)}"
                rows.append((name, r, n, g))
                record(rows[-1][0], r)
            elif kind == "unrolled":
                flat = GPT(dataclasses.replace(cfg, scan=False))
                p = flat.init(jax.random.key(0), jnp.zeros((1, cfg.context), jnp.int32))["params"]
                r = bare(flat, p, tokens(bpd), args.steps, what, 1 if args.tiny else 2)
                rows.append((f"bare jit, 1 device, G = {what}, blocks unrolled", r, 1, what))
                record(rows[-1][0], r)
            else:
                new = fusion(args.tiny, args.steps, what, args.dump_hlo)
                fuse = [*(fuse or []), *new]
                record(label, new)
        except Exception as e:
            if not rows or args.tiny:  # no baseline, or the script check: fail loudly
                raise
            failed.append(f"{label} ({type(e).__name__}: {str(e)[:300]})")
            record("failed", failed[-1])
        last = time.perf_counter() - t0
    if skipped:
        record("skipped", skipped)
    if job is not None:
        record("main job", job)
    md = markdown(head, rows, fuse, mfu, job, skipped, failed)
    print("\n" + md)
    if args.write:
        H.write_block(args.write, md, args.block)
        print(f"wrote the GPU section of {args.write}")
    return md


if __name__ == "__main__":
    main()
