"""The "reading the numbers" paragraphs of BENCHMARKS.md, built from the results.

Every figure quoted here comes from the run that writes the file; the prose says what the
figures mean and where a goal is or is not met.
"""

from __future__ import annotations

from typing import Any


def comm_reading(res: dict[str, Any]) -> str:
    ratios = [r["ratio"] for r in res["rows"]]
    worst = max(res["rows"], key=lambda r: r["ratio"])
    return f"""\
**Reading the numbers.** Goal: at most 1.01x the ZeRO volume. Measured: {min(ratios):.4f}x to
{max(ratios):.4f}x (worst: stage {worst["stage"]}, {worst["mode"]}). What is above theory is
bucket-end padding (interleaved buckets pad each parameter to a multiple of N and bucket ends to
`lcm(N, 128)`) and the scalar metrics (loss, the squared-norm sum; under
`deterministic_reduction` they are all-gathers of one scalar per rank). The fp32 wire doubles the
gradient half of the traffic, as Megatron's `grad_reduce_in_fp32` does;
`reduce_scatter_with_fp32_accumulation` gets fp32 accumulation for the bf16 price: its
`all_to_all` sends the same bytes as a ring reduce-scatter. `deterministic_reduction` at stage 0
replaces each all-reduce by an `all_to_all` plus an `all_gather`: the same bytes. Stage 3 gathers
every bucket twice (forward, and again in the backward instead of keeping the params alive) and
reduce-scatters it once: the `3Psi(N-1)/N` of the ZeRO paper when all three are bf16."""


def numerics_reading(res: dict[str, Any]) -> str:
    rows = res["rows"]
    first, last = rows[0], rows[-1]
    fp32_ok = all(r["fp32 wire exact"] == 1.0 for r in rows)
    a2a_ok = all(r["all_to_all + fp32 sum exact"] == 1.0 for r in rows)
    return f"""\
**Reading the numbers.** The bf16 ring rounds its running sum to bf16 at every one of its N - 1
hops: its error grows from {first["bf16 ring err"]:.1e} at N = {first["N"]} to
{last["bf16 ring err"]:.1e} at N = {last["N"]}, and the share of correctly rounded elements
falls from {first["bf16 ring exact"]:.0%} to {last["bf16 ring exact"]:.0%}. Both fp32 paths stay
on the floor set by rounding the exact mean to bf16 once
({"every element correctly rounded at every N" if fp32_ok and a2a_ok else "see the table"}),
including N = 12, 24, 48, 96 and 384, where a pre-scale by 1/N is inexact in bf16. That is the
property `tests/test_fp32_accumulation.py` asserts through `reduce_gradients` and `DataParallel`."""


_TIMER_KEYS = (
    ("xla_partition", "partitioner"),
    ("xla_fusion", "fusion"),
    ("xla_other", "other passes"),
    ("xla_backend", "backend"),
)


def _timer_reading(res: dict[str, Any]) -> str:
    """What the third table of section 7 says: each difference that matters for the goal,
    split by where XLA's timers put it."""
    rows = {(r["target"], r["variant"]): r for r in res.get("timers") or []}
    pairs = (
        ("plain+norm", "plain", "the norm (plain `jit` + norm over plain `jit`)"),
        ("stage0", "plain+norm", "stage 0 over plain `jit` + norm"),
        ("stage1", "zero1+norm", "stage 1 over the GSPMD ZeRO-1 peer + norm"),
    )
    out = []
    partitioner: dict[tuple[str, str], str] = {}  # (target, variant): its partitioner's extra
    for target, name in (("h100", "8 compile-only H100s"), ("cpu", "XLA:CPU")):
        found = []
        for a, b, what in pairs:
            if (target, a) not in rows or (target, b) not in rows:
                continue
            ra, rb = rows[(target, a)], rows[(target, b)]
            split = ", ".join(f"{label} {ra[k] - rb[k]:+.1f}" for k, label in _TIMER_KEYS)
            found.append(f"{what} {ra['compile'] - rb['compile']:+.1f} s ({split})")
            partitioner[(target, a)] = f"{ra['xla_partition'] - rb['xla_partition']:+.1f}"
        if found:
            out.append(f"{name}: " + "; ".join(found))
    if not out:
        return ""

    def part(target: str, variant: str) -> str:
        return partitioner.get((target, variant), "?")

    return (
        "\n\n*Where it goes* (the third table; one process each, so each figure carries this "
        "machine's noise, up to 1.5x between processes): " + ". ".join(out) + ". The norm is "
        "one reduction per parameter for every stage of the compiler to handle: the fusion "
        "passes (XLA joins each sum of squares to the update that reads the same gradient, "
        "one multi-output fusion per parameter, so no extra pass over the gradients runs), "
        "the other passes and the code generation. What jaxdp adds shows most steadily in "
        "the partitioner column (stage 0 over plain `jit` + norm, stage 1 over its peer: "
        f"{part('h100', 'stage0')} / {part('h100', 'stage1')} s on the H100s, "
        f"{part('cpu', 'stage0')} / {part('cpu', 'stage1')} s on XLA:CPU): Shardy's export and "
        "the SPMD passes run over a `shard_map` with one operand and one result per parameter, "
        "a cost that grows faster than the operands (the last table); the other columns move "
        "as much from one process to the next as between the variants."
    )


def _instruction_reading(res: dict[str, Any]) -> str:
    """What the instruction table of section 7 says: each stage over plain ``jit`` and the
    goal, by counts that do not move with the machine's load."""
    rows = res.get("instructions") or []
    if not rows:
        return ""
    goal = res.get("goal", 1.3)
    parts = []
    for r in rows:
        where = "XLA:CPU" if r["target"] == "cpu" else "H100s"
        stages = [f"stage {v[-1]} {r[f'{v}_ratio']:.2f}x" for v in ("stage0", "stage1") if v in r]
        peers = [
            f"{label} {r[v] / r['plain']:.2f}x"
            for v, label in (("plain+norm", "plain `jit` + norm"), ("zero1+norm", "ZeRO-1 + norm"))
            if v in r
        ]
        parts.append(f"{where} {r['leaves']} leaves: " + ", ".join(stages + peers))
    over = [
        f"stage {v[-1]} on {'XLA:CPU' if r['target'] == 'cpu' else 'the H100s'} at "
        f"{r['leaves']} leaves ({r[f'{v}_ratio']:.2f}x)"
        for r in rows
        for v in ("stage0", "stage1")
        if v in r and r[f"{v}_ratio"] > goal
    ]
    verdict = (
        "Every counted compile is within the goal."
        if not over
        else "Over the goal by count: " + "; ".join(over) + "."
    )
    return (
        "\n\n*Counted in instructions* (the instruction table; the same program counted "
        "twice differed by 0.1-0.5%, so unlike the seconds these ratios are the programs' own): "
        + "; ".join(parts)
        + f". {verdict} The counts leave out `init` and lowering (in the seconds above) and "
        "what the seconds also weigh, such as cache misses, and stop at 100 leaves (a "
        "1,000-leaf H100 compile runs about an hour under callgrind; at 300 leaves, by hand, "
        "stage 1 counted 43.76 billion against plain `jit`'s 42.62, 1.03x), so the 1,000-leaf "
        "verdict stays with the seconds."
    )


def compile_reading(res: dict[str, Any]) -> str:
    rows = res["rows"]
    cpu = [r for r in rows if r["target"].startswith("CPU")]
    gpu = [r for r in rows if r["target"].startswith("H100")]
    big = cpu[-1]

    def pair(r: dict[str, Any]) -> str:
        return f"{r['stage0_ratio']:.2f}x / {r['stage1_ratio']:.2f}x"

    def listing(rs: list[dict[str, Any]]) -> str:
        return ", ".join(f"{r['leaves']} leaves {pair(r)}" for r in rs)

    gpu_txt = listing(gpu) if gpu else "not measured (no gpu-aot extra)"

    def peer_listing(key: str) -> str:
        return ", ".join(
            f"{'XLA:CPU' if r['target'].startswith('CPU') else 'H100s'} {r['leaves']} leaves "
            f"{r[key]:.2f}x"
            for r in rows
        )

    goal = res.get("goal", 1.3)
    flagged = [r for r in rows if r.get("noisy")]
    caveat = "".join(
        f" In the {r['target']} row at {r['leaves']} leaves plain `jit`'s median"
        f" ({r['plain']:.2f} s) came out above plain `jit` + norm's ({r['plain_norm']:.2f} s),"
        " which does strictly more: that row measured this machine's swings, and its goal is"
        " not judged."
        for r in flagged
    )
    return f"""\
**Reading the numbers.** Goal (issue 21): at most {goal}x plain `jit`. XLA:CPU: {listing(cpu)};
compile-only H100s (the program a GPU user compiles): {gpu_txt} (stage 0 / stage 1).{caveat}

*Against like-for-like peers* (the second table): jaxdp's step does two things plain `jit`
does not. Its metrics carry the gradient norm (`grad_norm`, which clipping reads), and stage 1
shards the optimizer; either costs any implementation compile time. Plain `jit` that also
returns the norm: {peer_listing("plain+norm_ratio")} of plain `jit`; the GSPMD ZeRO-1 peer that
also returns it: {peer_listing("zero1+norm_ratio")}. Stage 1 against that peer:
{peer_listing("stage1_peer_ratio")}; stage 0 against plain `jit` + norm:
{peer_listing("stage0_peer_ratio")}. What stage 1 costs beyond its peer is jaxdp's own (its
reduce-scatters and gathers typed per parameter in `shard_map`, the padded shard views; the
bucket-by-bucket ordering of the gathers on GPUs measured nothing at 100 leaves: 2.87 / 2.98 /
3.13 / 3.24 s with it, 2.91 / 3.00 / 3.25 / 2.84 without, by hand on 2026-11-28; at 1,000
leaves it took 9-20% of the XLA compile, below). The goal stays against plain `jit`. A
hand-built step at 200 leaves on the H100s (2026-11-28, XLA
compile, medians of 4 rounds) put the norm first: plain `jit` 3.92 s, the GSPMD ZeRO-1 peer
without a norm 3.81, jaxdp's structure (gradients in `shard_map`, a `psum_scatter` per
parameter, the sharded AdamW, the gathers) without a norm 3.88, the same with
`optax.global_norm` 5.30, jaxdp stage 1 5.76.{_instruction_reading(res)}{_timer_reading(res)}

The gradient norm on GPUs is summed over concatenations of 8 reduced gradients
(`jaxdp._src.comm.per_param.NORM_CHUNK`, since `39e3c00`; XLA:GPU fuses each concatenation into the
reduction that reads it) instead of one reduction per parameter, which XLA joined to every
update as a multi-output reduction fusion. Counted in instructions (8 compile-only H100s),
stage 1 at 100 leaves 17.91 -> 15.70 billion and at 300 leaves 49.89 -> 43.76 (chunks of 4 /
16 / 32: 45.16 / 44.28 / 46.84), stage 0 16.04 -> 13.84 and 45.81 -> 38.62; plain `jit` 13.09
and 42.62. The same idea in chunks of about sqrt(N) had been dropped on 2026-11-28 on
seconds: faster at 100 leaves, slower at 1,000 and 2,000 (164.1 / 181.2 s against 152.4 /
150.9), which the 300-leaf counts bear out for wide chunks (32: +7% over 8).

Two changes of 2026-11-29, counted in instructions at 100 leaves (plain `jit`: 13.02 billion on
8 compile-only H100s, 4.88 on XLA:CPU). The gradients' mean divisor `G x dp`, where it is a
power of two, is carried by the loss (`jaxdp._src.strategy.loss_divisor`: the backward pass starts
from the
cotangent `1/d`, the same bits come out, and no multiply per parameter is left for the compiler
to carry): stage 0 13.84 -> 13.32 (H100s) and 6.08 -> 5.92 (XLA:CPU), stage 1 15.70 -> 14.91 and
7.28 -> 6.99; at stage 0 with a bf16 wire it also removes the pass that scaled each gradient
before its all-reduce (section 11: 45.36 -> 44.45 gradient volumes). And on a 1-D mesh the
gathers after the update are the partitioner's (a sharding constraint to replicated,
`ShardedOpt._gather_global`) instead of a second `shard_map`: stage 1 14.91 -> 14.68 and
6.99 -> 6.73. The same resharding had been measured on 2026-11-28 in seconds (200 leaves, XLA
compile 5.92 / 6.13 / 6.05 / 6.01 s against 6.01 / 6.25 / 5.76 / 5.91) and dropped as no
change; counted, it is 1.5-4% at 100 leaves, and at 1,000 leaves it removes a `shard_map` of
1,000 operands and 1,000 results, whose cost in Shardy grows with the square of its operands.
XLA forms the same combined all-gathers, and section 11's traffic and peaks are unchanged.

A third change of 2026-11-29: jaxdp's engine modules (`jaxdp/_*.py`) are registered with JAX
as frames of its own (`jaxdp._src.platform.frames`, as flax registers its module machinery), so an
operation's source location starts at the user's code instead of a chain of engine frames.
XLA's importers had spent twice plain `jit`'s instructions on locations
(`GenerateInstructionLocation`, 50 against 100 million at 100 leaves on XLA:CPU). Counted at
100 leaves: XLA:CPU stage 1 6.81-6.86 -> 6.60 billion, stage 0 5.90 -> 5.80; H100s stage 1
14.66 -> 14.22, stage 0 13.27 -> 12.93 (the "before" of XLA:CPU are three counts by hand of the
code before, in this session's environment: the last run's table had 6.68 for the same code, so
counts repeat to 0.1-0.5% within a session but differed by up to 2.7% between two sessions'
fresh environments). With no locations at all (`JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0`, both
sides) XLA:CPU counted plain `jit` 4.85 and stage 1 6.63: locations no longer cost jaxdp more
than they cost plain `jit`. Also measured and not kept: stage 1's gradient norm on XLA:CPU
is a 100-operand concatenation (the bucket, rebuilt so the norm is the bucketed path's bit for
bit) whose copy kernel is 57 KB of LLVM IR, 40% of the step's; summed in chunks of 8, 25 or
100 parameters it counted 7.10, 6.91 and 6.84 (6.81-6.86 as it is), and without any norm
6.57. The 49 copies of the donated params XLA:CPU inserts at stage 1 (the new params do not
wait for the last reads of the old ones without combined collectives) go when the update
waits for the norm (a bitwise OR per parameter), but that counted 7.12.

What is left at 1,000 leaves, counted on XLA:CPU (one compile each, billions of instructions):
plain `jit` 55.96, stage 0 80.83 -> 77.32 with the loss's divisor (1.38x), stage 1 96.68 (1.73x;
95.76, 1.71x, once the engine's frames left the locations). Of
stage 1's +40.7: XLA:CPU's thunk execution graph +13.9 (2,000 collective thunks, one
reduce-scatter and one all-gather per parameter, which XLA:CPU never combines, each checked
against the others and the edges pruned), Shardy +14.0 (+8.0 of it rebuilding the body
arguments' shardings of the step's `shard_map` on every lookup, `eraseManualAxes`: 1,000
params, each looked up at each use), the SPMD partitioner +3.9 (tuple shardings of the same
operands) and LLVM +3.2. Stage 0 pays Shardy +10.5 (+8.1 in the argument lookups) and the
partitioner +3.5, but not the thunk graph. Tried and dropped: the optimizer update inside the
step's `shard_map`
(elementwise optimizers are the same there, bit for bit): its 400 more operands made the
argument lookups cost 1.15 billion instead of 0.14 at 100 leaves, and the step 8.89 against
7.28 (XLA:CPU), although Shardy's propagation over the update fell by 0.14.

Measured on 2026-12-01 and not kept (XLA:CPU, 100 leaves, instructions of the step's compile,
one count each; plain `jit` 4.89 billion in `bench_compile.instructions`, 4.97 in the harness
that ran the variants, which counted stage 1 as it is at 6.61). Where stage 1's +1.64 billion
over plain `jit` goes (callgrind, inclusive): Shardy +0.63 (its propagation over the sharded
update +0.27, the `shard_map` argument lookups +0.08, explicit reshards +0.08), LLVM +0.37
(most of it the norm's concatenation kernel), the StableHLO-to-HLO conversion +0.18, XLA:CPU's
thunk execution graph +0.12 (it checks every pair of thunks for conflicts, 1.6 million checks
here, so its cost grows with the square of the thunks; stage 1 has about 1.4x plain `jit`'s:
the 100 reduce-scatters and 100 all-gathers XLA:CPU never combines, and 49 param copies), the
fusion emitter +0.10 and the SPMD partitioner +0.07. Five changes, each against 6.61:
reduce-scatter as a `psum` and a `dynamic_slice` of this rank's part (XLA:CPU combines
all-reduces into one; the same bits) 7.41, the HLO passes +0.87 over the slices against -0.02
in the thunk graph; an `optimization_barrier` over the params at the top of the gradient
`shard_map` (one use of each argument) 6.66, the argument lookups unchanged (508 of them: they
come from the manual computation's own edges, not from the body's uses); the packed buckets
again (the per-parameter switch off) 23.97, and at 1,000 leaves 83-98 s of compile against
16-19 s (3,000 slice fusions); a state that is not donated 6.48 (the 49 copies and their
aliasing cost 0.13, less than ordering the gathers, 7.12 above); and GSPMD's propagation
instead of Shardy (`JAX_USE_SHARDY_PARTITIONER=false`, both sides) plain `jit` 4.24 and stage 1
5.12, but JAX is removing GSPMD, so a library cannot choose it. Counted again at 1,000 leaves,
stage 1 is 95.76 (1.71x), as before.

*Stage 0* all-reduces each parameter on its own (`jaxdp._src.comm.per_param.AllReduceOps`): no
bucket
to pack, and no slice of a bucket fused into every optimizer update. On XLA:CPU a loop fusion
with a `slice` costs about 20 ms to emit against about 1 ms for an elementwise one (the
bucketed step had 2,000 of them at 1,000 leaves, 3.9x plain `jit`). On GPUs the step compiles
with XLA's `all-reduce-contiguous` pass off (`jaxdp._src.comm.per_param.PASSES_OFF`, merged into
whatever options the step is given), which copies the operands of every combined all-reduce
into one buffer and back; no flag turns it off in jaxlib 0.10.2, but the per-program
`xla_disable_hlo_passes` option does. Until `d9e9437` GPUs kept the buckets, and their
updates read slices of a bucket at their own offsets: XLA's multi-output fusion merged them
into a few large kernels, no two the same, each compiled on its own (1,000 leaves: 88 GPU
modules, against 20 per parameter and 17 for plain `jit`). Measured on 2026-11-28 (8
compile-only H100s, XLA compile, least of three in one process, variants alternating in 3
rounds): at 100 leaves per parameter 2.08 s (medians) against the buckets' 2.62 and plain
`jit`'s 1.80; the 100.7M GPT of section 11 moves 44.86 gradient volumes per step per
parameter, 45.44 with buckets, and 46.86 per parameter with the pass on.

*Stage 1* reduce-scatters and gathers each parameter (no slice fusions either), and on
XLA:CPU, which runs collectives one at a time in program order, it no longer chains the
gathers bucket by bucket (one fused OR per parameter, 15% of its compile at 1,000 leaves; GPUs
kept them until 2026-11-28, below). What is left, from `perf` on a fresh process at 1,000
leaves (stage-1 XLA compile
19.2 s against plain `jit`'s 11.9 s): Shardy's handling of the `shard_map` operands (+2.1 s,
most of it `eraseManualAxes`, which grows with the number of operands: one per parameter,
master shard and moment), XLA:CPU's thunk execution graph (+2.1 s: 2,000 more collective
thunks), the SPMD partitioner (+0.5 s) and more fusions to emit (the padded views).

Looked at again at `4c2ac43` (1,000 leaves, XLA:CPU, `perf` over one stage-1 compile): the
largest single cost is XLA:CPU's thunk execution graph, which checks every thunk's buffers
against the others' and then prunes the edges (`ReadWriteSet::HasConflicts`,
`ExecutionGraph::EraseEdge`, the transitive reduction: about 14% of the samples), so each
thunk costs more the more there are: stage 1 has 2,000 collective thunks (one reduce-scatter
and one all-gather per parameter, which XLA:CPU never combines; it does combine stage 0's
all-reduces into one) where plain `jit` has one all-reduce. Two changes measured and dropped:
the end-of-step gathers in `shard_map`s of 100 parameters (Shardy 6.3-7.3 -> 5.6-6.9 s of a
40 s compile, within the run-to-run noise of the whole), and ordering every update after the
gradient norm (it removes the 49 copies of weight matrices XLA:CPU inserts at 100 leaves,
because nothing orders a backward GEMM's read of a donated weight before the unordered gather
that overwrites it, but the compile did not measurably change).

Stage 0 at 1,000 leaves (XLA:CPU, one fresh process each, at `e605931`): its XLA compile took
12.7-13.4 s against plain `jit`'s 9.3-9.5 s, of which the SPMD partitioner is +1.9 s (Shardy
+1.2 s) and the CPU backend +0.5 s. Shardy's cost grows faster than the number of `shard_map`
operands: running stage 0's optimizer update inside the `shard_map` as well (replicated, so the
same numbers; 4,000 operands and 3,000 results instead of 1,000 and 1,000) took that compile to
31.6 s (Shardy 15.8 s), so the update stays outside. With buckets on GPUs (before `d9e9437`),
compiled for 8 H100s at 100 leaves, stage 0 had 27 distinct kernels against plain `jit`'s 15.
Reading the slices at offsets passed in at run time (`dynamic_slice`) made those kernels
identical but not the compile faster (2.35-2.38 s against 2.31-2.32 s), and copying the
slices out first (plain `jit`'s way) would have cost a pass over the gradients every step.

The gradient norm and the rest of stage 1's gap on GPUs, measured by hand on 2026-11-28 (8
compile-only H100s, XLA compile seconds, variants alternating in rounds: the forms of the norm
one compile in a fresh process each, the rest the least of two compiles in one process; this
machine's speed swung by up to 1.5x between rounds). The norm is
one reduction per parameter, and XLA:GPU compiles reductions slowly whatever their form: 400
sums of squares of 128 floats alone took 0.76 s against 0.22 s for 400 multiplies (priority
fusion 0.23 s of it). At 1,000 leaves plain `jit` compiled in 21.5 / 23.1 / 23.4 s and with
`optax.global_norm` in 26.8 / 30.3 / 29.2 s, so a step that reports `grad_norm` has little
of the 1.3x left there. Summing the squares as a pairwise tree instead of a stacked
sum (26.2 / 26.2 / 27.5 s, and one 36.6 s outlier, against 26.6 / 26.6 / 26.8), or behind
optimization barriers (200 leaves: 5.06-5.51 s against 5.11), saved nothing. One profiled
compile of stage 1 at 1,000 leaves took 39.9 s against plain `jit` + norm's 26.3 s: the
bucket-by-bucket ordering of the gathers +3.3 s (multi-output fusion +2.4 s), then Shardy
+2.5 s and the SPMD partitioner +0.9 s (the `shard_map` operands) and fusion +2.1 s. Dropped:
the gathers in `shard_map`s of 100 parameters (38.5 / 34.6 s against 38.1 / 36.5 s, both
unordered); the order moved onto the reduced gradients before the update, which made every
update wait for the norm (+2.8 s; priority fusion +2.2 s); and the order's OR with a zero
(`jaxdp._src.comm.order.after`) replaced by a multiply by a one derived the same way: alone, 1,000
arrays each doubled and ordered compiled in 0.83 s against 1.76 s with the OR (0.67 s
unordered), but stage 1 at 1,000 leaves took 43.6 / 43.4 s against 42.3 / 42.5 s.

The ordering itself went on 2026-11-28 (8 compile-only H100s). It had made bucket `k+1`'s
gathers wait for bucket `k`'s and the first for the norm, so that XLA could not start every
gather first and keep every gathered bucket alive beside the params it is split into. Per
parameter there is nothing to split (a gathered parameter is the param, reshaped, or sliced
where the layout padded it), and without the ordering the compiled programs keep no copy: the
100.7M GPT of section 11 (bf16 params, fp32 master), peak per device with / without it, stage 1
3.891 / 3.884 GiB at dp 8 (3.891 / 3.872 with `check_for_nan_in_grad`) and 4.767 / 4.767 at
dp 6 (every parameter padded), stage 2 at `G = 4` 3.932 / 3.932; traffic 37.89 / 37.83 gradient
volumes (stage 1; 40.18 / 40.12 with `check_for_nan_in_grad`); section 4's MLP the
same but for one bucket at `G = 1` (stages 1-2 temp 0.27 / 0.58 B/param). XLA still combines the
gathers into groups of at most one bucket, done one after the other (the test of the
end-of-step gathers holds unchanged). Compile, `aot.compile_step` CPU seconds, variants
alternating in 3 rounds, with `check_for_nan_in_grad`: that GPT's stage 1 18.2 / 17.6 /
18.4 s with the ordering against
15.1 / 15.4 / 14.6 s without, stage 2 at `G = 4` 20.2 / 19.4 / 21.1 against 15.3 / 15.4 / 15.5;
this section's MLP, stage 1 XLA compile (least of two in one process), 1,000 leaves
38.8 / 40.7 / 40.1 s against 38.8 / 39.2 / 34.8, 100 leaves 2.65 / 2.88 / 2.52 / 3.52 against
2.59 / 2.88 / 2.47 / 2.82. What the ordering was for on a GPU's clock, the overlap of the
gathers with the last updates, was small in the compiled GPT either way: with it 2 of 5 gather
groups overlapped compute (31 and 2 instructions), without it 1 of 3 (5 instructions).

Stage 3's compile, compiled for 8 H100s (the 100.7M GPT of section 11, `G = 1`): at `620a004`
20.1 s against 10.5 s for the GSPMD FSDP peer with the same remat rule, the programs the same
size before optimisation (14,040 against 13,718 HLO instructions). The difference was in
kernels: 155 LLVM modules against 102 (PTX +2.1 s, LLVM IR +1.7 s) and XLA's multi-output
fusion pass 2.3 s against 0.3 s. Each parameter's optimizer update was a kernel of its own (46
of them used once), because each held the concatenation of its bucket's reduce-scattered
pieces (60 operands) and sliced its own part out: the custom VJP of the per-parameter gathers
returned the reduced gradient as the cotangent of one accumulator per bucket. XLA fused that
concatenation into every consumer, so it cost no memory traffic, but no two updates were the
same kernel. Now stage 3 keeps one accumulator per parameter where it gathers and
reduce-scatters per parameter on a bf16 wire (`jaxdp._src.zero3.gather.reduces_per_parameter`), as
stages 1-2 reduce into the optimizer's per-parameter shards: 12.5 s, 118 modules, multi-output
fusion 0.43 s, with 35.21 gradient volumes of traffic and a 2.81 GiB peak (35.27 and 2.83
before).

`init` compiled the whole state as one program: at 1,000 leaves 1.9 s of XLA:CPU compile
(`init` 3.7-3.8 s in all) against 0.9 s for plain `jit`'s `optimizer.init` (the master view's
1,000 partition-offset slices 1.6 s, the working params' copies 0.75 s and the sharded
optimizer zeros 1.3 s, measured apart), and 4.3 s for the 8 compile-only H100s, where plain
`jit`'s `optimizer.init` compiles in 0.55 s (the H100 rows count neither: both sides' `init`
is only traced there). Now (`jaxdp._src.engine.state_build`) a model of 64 or more leaves
that repeat a few shapes (8 or more leaves per kind on average) gets one small jitted
conversion per kind of leaf, called once per leaf, and one `jax.jit(optimizer.init)`: the same
state bit for bit (`tests/test_state_build.py`), compiled for the H100s in 0.74 s instead of
4.3 s at 1,000 leaves; on XLA:CPU `init` took 2.7 s instead of 3.8 at stage 1 and 2.2 s
instead of 2.7 at stage 0 (one process each, CPU seconds; what is left: tracing the state
for its shardings and the optimizer's `init` once more, 0.3 s each, the 2,000 dispatches and
the 1,000 transfers of the replicated params). At 100 leaves it changed nothing measurable on
XLA:CPU (0.30-0.35 s either way; 0.28 -> 0.18 s compiled for the H100s); below 64 leaves the
one program is kept, as its fewer compiles win (16 leaves: 0.2-0.3 s against 0.3-0.6 s).
In the table stage 1's `init` at 1,000 leaves reads {big["stage1_init"]:.2f} s
(3.87 s in the run before this change); its ratios moved within this machine's noise,
which the unchanged H100 rows show (plain `jit` at 1,000 leaves 33.6 s in that run).
Copying the working params with `jax.device_put(..., may_alias=False)` instead of a program
had taken 1.15 s against 0.75 s.

At 100 leaves on XLA:CPU stage 1 had 659 fusions against plain `jit`'s 556 (measured at
`ae7786e`). 100 of the extra ones multiplied each reduced gradient shard by 1/dp on its own:
the update folds the scale into its constants, but the gradient norm rebuilt each bucket from
the scaled shards by a concatenation, which XLA:CPU does not fuse, so every scaled shard was
written out first. Since `83c185b` the norm rebuilds each bucket as `fill(r * d) * (1/d)` for
a power-of-two divisor `d` (`jaxdp._src.comm.per_param`): the same bits, and XLA cancels the scale,
so
the concatenation reads the reduce-scatters' outputs as they are (559 fusions; the norms and
params are the bucketed path's bit for bit, `tests/test_engine_parity.py`). The compile time
barely moved: XLA compile 1.79 s against 1.86 s at 100 leaves (means of 15 compiles, the two
versions side by side) and 20.6 s for both at 1,000 leaves; an earlier estimate from 6 fresh
processes (1.85 -> 1.66 s) was within this machine's noise. Where stage 1's XLA compile goes
at 100 leaves (XLA's own pass timings from a profile, 3 fresh processes each, stage 1 against
plain `jit`): the whole compile 1.25 s against 0.70 s, of it Shardy 0.35 against 0.11 s (half
of the difference: its conversions between HLO and StableHLO and its propagation, which at
stage 1 runs over the update's sharded arrays), the backend 0.38 against 0.27 s, the HLO passes
around layout assignment 0.35 against 0.23 s and copy insertion 0.12 against 0.07 s. An
AdamW update on 200 arrays sharded over the data axis compiles in about 1.8 s, in a
`shard_map` in 1.7 s and replicated in 1.7 s, so moving the update into the step's
`shard_map` would save little. At 1,000 leaves (one fresh process each, same machine,
`83c185b`) stage 1's XLA compile took 17.6 s against plain `jit`'s 10.5 s: Shardy 4.2 against
1.7 s, the rest of the SPMD partitioner 1.5 against 0.5 s, the backend 5.4 against 3.0 s. Of
Shardy's time (`perf`), 39% is one lookup: the sharding of a `shard_map` body's argument is
read through `ManualComputationOp::getBlockArgumentEdgeOwnerShardings`, which rebuilds the
shardings of all the body's arguments (`eraseManualAxes`) to return one, so a body with N
arguments costs N^2 (`InsertExplicitReshardsPass` and `AddDataFlowEdgesPass`, about 1.2 s at
1,000 leaves, nothing at 100). The step's gradient `shard_map` takes every parameter and its
gather takes every master shard; splitting the gather would halve that at most. On its
one-program path `init` does not trace its program twice: `jax.eval_shape` of the
state builder and the `jit` with `out_shardings` share one trace (constraining the outputs
inside the one `jit` instead left `init` at 5.0-5.4 s at 1,000 leaves, unchanged).

On the compile-only H100s (XLA's own pass timings from a profile, one fresh process each,
`--xla_gpu_force_compilation_parallelism=1`, measured by hand): at 1,000 leaves plain `jit`'s
XLA compile took 41.8 s and stage 1's 69.5 s, of it multi-output fusion 6.3 against 16.5 s and
the SPMD partitioner with Shardy 2.9 against 9.8 s. Most of the multi-output fusion was the
gradient norm, summed over each bucket rebuilt from its parameters' reduced shards (a
concatenation of every gradient); summed parameter by parameter on GPUs
(`jaxdp._src.comm.per_param.nccl_collectives`) stage 1's XLA compile took 56.9 s, multi-output
fusion
7.3 s, partitioner and Shardy 7.9 s (since `39e3c00` in concatenations of 8, above). XLA:CPU
keeps the bucket sum: it compiles one reduction of a concatenation far faster than one per
parameter (its fusion pass 1.3 s against 7.7 s at 1,000 leaves). At 100 leaves the rest of the
gap is kernels: 32 distinct kernels against plain `jit`'s 15, each its own LLVM module (50-70
ms of CPU each). Identical fusions become distinct kernels when their buffers' alignment
differs (XLA specialises a kernel on it): stage 1's donated working params are dead from their
last use until the gather rewrites them, XLA places temporaries in them (the first layer's
kernel, last read by the first GEMM, holds the second layer's activation), and an entry
parameter is 16-byte aligned where XLA's own buffers are 256-byte aligned, so the forward,
input-gradient and weight-gradient GEMMs of the MLP come in three alignments each. Keeping the
old working params alive until the gather (one element of each read after the gradient norm,
before the first gather) took the kernels from 33 to 26-28 (a step that does not donate its
state has 26 too; plain `jit` 16) but made the compile slower, not faster: 3.0-3.7 s against
2.3-2.9 s (fresh processes, `83c185b`; the reads' chain of ORs made the simplifier iterate 25
times instead of 2, and one stacked read instead still cost 0.7 s). Dropped. The other part of
the 32 is the gradient norm, which jaxdp's metrics return and the plain step does not compute:
counted again at `99130ba` (PTX `.entry`s of the step, 100 leaves), stage 1's norm is 7 kernels
of its own (a sum of squares per parameter in three variants, two sums of those sums, the
square root and a scale), the GEMMs 9 against the plain step's 5, and the backward's adds and
bias sums 7 against 4. Plain `jit` returning `optax.global_norm` of its gradients as well has
17 kernels, not 15: XLA folds the norm's sums into the AdamW update's fusion. At stage 1 it
cannot: the first gather waits for the norm (so no gather overwrites a donated weight before
the backward's last read of it, and the gathered buckets are not all alive at once), and XLA
fuses that wait into each parameter's update, so every update reads the finished norm.

The same count on the main job's kind of model (the 100.7M GPT of section 11, bf16 working
params, compiled for 8 H100s, one fresh process each, measured by hand on 2026-11-27): stage
1's XLA compile took 12.2 s against 7.9 s for the GSPMD sharded peer (XLA's pass timings:
priority fusion 3.2 against 1.9 s, PTX to CUBIN 3.1 against 2.0 s, the SPMD partitioner 1.1
against 0.6 s), with 138 kernels against 91. Of the extra 47, 21 are AdamW updates: 31 update
kernels against the peer's 10, although, names aside, their fused computations are the same
for every parameter of a shape. The gradient shard an update reads is an output of a combined
reduce-scatter, and those outputs sit at 16- or 256-byte aligned offsets, on which XLA
specialises a kernel; the peer's update reads a sliced copy of its reduce-scatter's result and
gets one kernel per shape. Most of the other 26 are the gradient norm, which the peer does not
compute (25 sums of squares). Two changes were measured and dropped (stage-1 compile of the
whole step 15.1-15.6 s in CPU seconds): padding every parameter's shard to a multiple of 128
elements (144 kernels, 14.5-16.1 s: the offsets still vary, and pads were added), and, as an
experiment only, ordering the first gather after the loss instead of the norm (XLA then folds
the norm's sums into the updates as at `jit`: 127 kernels, 15.9 s).

Three more were measured on 2026-11-28 (`a081307`, 8 compile-only H100s, stage 1, XLA compile
only: the lowered step compiled 3 times in one process and the least kept, one process per
variant, variants alternating in rounds; 4 rounds at 100 leaves, 3 at 1,000 with one compile
each; this machine's speed swung 1.6x between rounds, so only ratios within a round count).
Summing the norm over one concatenation of every reduced shard instead of one reduction per
parameter compiled 100 fewer kernels at 100 leaves (361 fusions against 460) and took 0.92x the
XLA compile at 100 leaves (medians 2.84 against 3.07 s) and 0.82-0.92x at 1,000 (50.7-56.6
against 55.4-67.9 s). XLA:GPU does not fuse a concatenation of that many operands into its
reduction: it writes a copy of every reduced shard (2/dp gradient volumes), the gradient
concatenation that the goal of section 11 rules out at stages 1-2; in chunks small enough to
fuse (above) it compiled slower than per parameter at 1,000 leaves. Dropped. So was one
variadic reduction per shape of shard (up to 32 operands each, no concatenation; 364 fusions at
100 leaves): no faster than per parameter (round medians 1.75x against 1.68x plain `jit`), so
the kernel count is not what costs. Gathering the new params without waiting for the norm (no
ordering at all) took 0.80-0.91x the XLA compile at 1,000 leaves, but XLA then starts every
gather first and keeps a full second copy of the params in temporaries (the test of the
end-of-step gathers); kept. That reason was the test's docstring, which described gathers of
whole buckets; measured later that day, the per-parameter gathers keep no copy, and the
ordering went (below). With no norm at all stage 1 compiled in 1.24-1.31x plain `jit` at
100 leaves against 1.50-1.54x with it (medians of the rounds): the norm is about half the gap
there.

The optimizer probe in `init` (three optimizer steps on small probe tensors, to refuse
optimizers that would change when sharded) does not run for this AdamW: a chain made only of
optax's elementwise and norm-based transformations with plain settings is recognised from its
parts (`jaxdp._src.optim.known`), and the "probe" column ({1e3 * big["stage1_probe"]:.1f} ms at
{big["leaves"]} leaves) is that recognition. An optimizer it does not recognise (a callable
mask, `multi_transform`, `inject_hyperparams`, one of your own) is probed as before: `init` and
one step traced for the whole and the sharded tree and evaluated with NumPy
(`jaxdp._src.optim.host_eval`),
compiling nothing, 3.3 s at 1,000 leaves in the last table that ran it for AdamW (nearly all of
it jax tracing the two step programs). Op by op through jax it took 1.06 s at 10 leaves in a
fresh process (every distinct op compiles once) and 4.3 s at 1,000. What we tried and dropped:
`--xla_cpu_use_fusion_emitters=false` (slice fusions 4x cheaper, the whole step slower to
compile), building buckets with `dynamic_update_slice` (slower), jitting the optimizer probe
(1,000 leaves 15 s), disabling Python's garbage collector
during `init` and lowering (10-25% of them, a process-wide side effect).{_operand_reading(res)}"""


def _operand_reading(res: dict[str, Any]) -> str:
    rows = res.get("operands") or []
    if not rows:
        return ""
    big, small = rows[-1], rows[0]
    return f"""

*Operands of a `shard_map`* (last table) cost the compiler more than linearly: one `shard_map`
of N operands and N results compiles in {small["one"] / small["jit"]:.1f}x plain `jit` at
N = {small["operands"]:.0f} and {big["one"] / big["jit"]:.1f}x at N = {big["operands"]:.0f}, the
same work split into `shard_map`s of 100 in {big["chunked"] / big["jit"]:.1f}x (`perf`: Shardy's
`eraseManualAxes` rebuilds every operand's sharding for each operand, and the SPMD partitioner
copies the tuple of all of them per element). jaxdp's step has one operand per parameter in
each of its `shard_map`s (the local gradients: params in, gradients out; at stages 1-2 also the
gather: shards in, params out), so part of the gap is this upstream cost. Not the larger part:
the gather split into `shard_map`s of 100 parameters (measured once by hand, 1,000 leaves)
compiled 0.6 s faster of stage 1's 16.6 s, and the gradients cannot be split that way (one
`value_and_grad` makes them all)."""


def scaling_reading(res: dict[str, Any]) -> str:
    rows = res["rows"]
    eight = [r for r in rows if r["devices"] == 8]
    one = [r for r in rows if r["devices"] == 1]

    def span(sub: list[dict[str, Any]], key: str, unit: str) -> str:
        vals = [r[f"jaxdp {key} {unit}"] / r[f"plain jit {unit}"] for r in sub]
        return f"{min(vals):.2f}x-{max(vals):.2f}x"

    return f"""\
**Reading the numbers.** On 8 simulated devices jaxdp's step takes {span(eight, "stage 0", "ms")}
(stage 0) and {span(eight, "stage 1", "ms")} (stage 1) of plain `jit`'s time; its per-device
memory is {span(eight, "stage 0", "MiB")} (stage 0) and {span(eight, "stage 1", "MiB")} (stage 1,
the optimizer state and master weights sharded 8 ways). On one device, where there is nothing to
communicate, jaxdp pays for its bookkeeping: {span(one, "stage 0", "ms")} of the time and
{span(one, "stage 0", "MiB")} of the memory at stage 0 (the packed gradient bucket beside the
per-leaf gradients; at stage 1 {span(one, "stage 1", "MiB")} with the fp32 master copy, which
plain `jit` with f32 params does not keep). On CPU more simulated devices add work (every
collective is a rendezvous of device threads on 2 cores) rather than speed, so the step time
grows with the device count for both; only the ratios are meaningful here."""


def memory_gpu_reading(res: dict[str, Any]) -> str:
    ratios = res.get("ratios")
    if not ratios:
        return "Skipped (no compile-only H100 devices), so nothing to read."
    cells = ", ".join(f"stage {s} G = {g}: {r:.2f}x" for (s, g), r in sorted(ratios.items()))
    over = [f"stage {s} at G = {g}" for (s, g), r in sorted(ratios.items()) if r > 1.10]
    verdict = (
        "every row is within the 1.10x goal"
        if not over
        else f"above the 1.10x goal: {', '.join(over)}"
    )
    return f"""\
**Reading the numbers.** This is the program the GPU would run (no XLA:CPU bf16 rewriting).
Total ÷ (ZeRO formula + allowance) on the several-bucket rows: {cells}; {verdict}. The allowance
is what no implementation avoids: the activations (measured on one device), two buckets of
in-flight bf16 gradients and, with micro-batches, the fp32 accumulator the stage keeps. Stage 3
gathers and reduce-scatters each parameter on its own (XLA's combiners merge them into groups of
at most one bucket), so every gathered parameter and every gradient is its own buffer that dies
after its last use. With one collective per bucket it measured 1.13x / 1.28x (G = 1 / 4): in
XLA's buffer assignment (`--xla_dump_to`), splitting a gathered interleaved bucket into its leaves
and packing the leaves' gradients back were whole-bucket copies kept alive beside the bucket,
three buckets at the forward peak. Stages 1-2 gather the updated params per parameter too, with
no ordering: a gathered parameter is the param itself, so no full copy of them is alive at the
end of the step. Until 2026-11-28 those gathers were ordered bucket by bucket (an OR with zero
per parameter and an XLA scheduling group per bucket); dropping that changed the temp on the
rows above only at one bucket and G = 1 (stages 1-2: 0.27 to 0.58 B/param) and cut XLA:GPU's
compile of the 100.7M GPT of section 11 by 13-27% (section 7)."""


def traffic_reading(res: dict[str, Any]) -> str:
    if not res.get("rows"):
        return ""
    rows = {r["program"]: r for r in res["rows"]}
    ours = [r for r in res["rows"] if "peer" in r]
    lines = []
    for r in ours:
        goal = 0.25 if not r["program"].startswith("jaxdp stage 3") else 0.0
        met = "met" if r["vs peer"] <= goal else "not met"
        lines.append(
            f"{r['program'][6:]}: {r['vs peer']:+.2f} against {r['peer']} (goal <= {goal:+.2f}: "
            f"{met})"
        )
    s3 = rows.get("jaxdp stage 3")
    sharded = rows.get("GSPMD sharded")
    peak = ""
    if s3 and sharded:
        ok = "met" if s3["peak GiB"] <= sharded["peak GiB"] else "not met"
        peak = (
            f" Stage 3's peak is {s3['peak GiB']:.2f} GiB against the sharded peer's "
            f"{sharded['peak GiB']:.2f} (goal: at most it, {ok})."
        )
    concat = [r["program"][6:] for r in ours if r["concat"] > 0]
    rep = rows.get("GSPMD replicated")
    pack = f"{rep['concat']:.2f}" if rep else "n/a"
    return f"""\
**Reading the numbers.** Non-GEMM traffic minus the matching peer's, in gradient volumes:
{"; ".join(lines)}.{peak} Gradient concatenations in jaxdp's programs:
{", ".join(concat) if concat else "none"} (the replicated peer's combined all-reduce copies
its operands into one buffer: {pack} gradient volumes, which is how the detector is checked on
a known program). Every stage reduces (and stages 1-2 gather) each parameter on its own and
XLA's combiners group them (one NCCL group call over the separate buffers), so nothing is
packed or unpacked; stages 1-2 reduce the gradients straight into the optimizer's shard
layout, and stage 0 compiles with XLA's `all-reduce-contiguous` off (section 7). The gradient
norm reads each reduced gradient once more (since `39e3c00`; section 7): summed in
concatenations of 8 fused into their reductions instead of inside every update, which was one
multi-output reduction fusion per parameter for XLA:GPU to compile (stage 0 +0.50 gradient
volumes, +1.00 with an fp32 wire; stages 1-3 +0.06 and +0.13, one shard of each
gradient).\
{_fp32_wire(rows)}{_stage0_wire(rows)}{_stage3_operands(rows)}"""


def _fp32_wire(rows: dict[str, Any]) -> str:
    bf16 = rows.get("jaxdp stage 1")
    plain, fused = (
        rows.get("jaxdp stage 1, fp32 wire"),
        rows.get("jaxdp stage 1, fp32 wire + fusion"),
    )
    if not (bf16 and plain and fused):
        return ""
    return f"""
With an fp32 wire and no fusion, each bf16 weight gradient the GEMM wrote is cast up to fp32 in
a pass of its own before its reduce-scatter ({plain["traffic"] - bf16["traffic"]:+.2f} against
the bf16 wire at stage 1); with `gradient_accumulation_fusion` (Megatron's fp32 main-grad path;
the GPT's dense layers are `jaxdp.nn`'s) the weight-gradient GEMMs write fp32 themselves and the
pass is gone ({fused["traffic"] - bf16["traffic"]:+.2f})."""


def _stage0_wire(rows: dict[str, Any]) -> str:
    s0 = rows.get("jaxdp stage 0, fp32 wire")
    if not s0:
        return ""
    return f"""

Stage 0 with an fp32 wire ({s0["vs peer"]:+.2f} against replicated) casts each bf16 gradient
up in a pass of its own before its all-reduce, as stages 1-2 do. With packed buckets (before
`d9e9437`) it moved 46.94 gradient volumes: the loss's and other metric sums waited for the
buckets' all-reduces (`ReduceAtEnd.order_metrics`, still there for the packed buckets), or
XLA's combiner merged the loss's `psum` into the partly filled last bucket's all-reduce and
XLA:GPU copied both into one buffer and back (47.63, measured by hand at `80aa235`); the
pre-scaling, done gradient by gradient in a bucket of more than 64 parameters
(`jaxdp._src.comm.reduce.Unpacked`: XLA:GPU fuses nothing into a concatenation of that many
operands),
took a 100-leaf MLP of 128 x 128 layers in fp32 (one bucket) from 16.26 to 10.26 gradient
volumes per step (plain `jit`: 11.26)."""


def _stage3_operands(rows: dict[str, Any]) -> str:
    s3, remat, sharded = (
        rows.get("jaxdp stage 3"),
        rows.get("GSPMD sharded + remat"),
        rows.get("GSPMD sharded"),
    )
    if not (s3 and remat and sharded):
        return ""
    return f"""

Stage 3 and its sharded + remat peer use the same rule, stage 3's default `remat_policy="gemm"`:
GEMM and fused-attention outputs, and the operands of batched dots (this model's XLA attention
reads its queries, keys, softmax probabilities and values through them), which stage 3 names by
evaluating the loss again (`jaxdp._src.zero3.dot_operands`; a policy sees only an equation's
outputs).
Before they were kept (`38e725a`; this section's run before it) stage 3 read and wrote 43.42
gradient volumes (its model part 42.48) at a 2.88 GiB peak, and the peer with jax's
`dots_with_no_batch_dims_saveable` 43.90 at 2.61 GiB: the backward pass rebuilt every layer's
head-split queries, keys and values and its probabilities from the projections' outputs. With
them stage 3 moves {s3["traffic"]:.2f}, less than the sharded peer that recomputes nothing
({sharded["traffic"]:.2f}), at a {s3["peak GiB"]:.2f} GiB peak."""


def dispatch_reading(res: dict[str, Any]) -> str:
    rows = res["rows"]
    by = {r["variant"]: r for r in rows}
    peers = {"fp32": by["bare jit, fp32"], "bf16": by["bare jit, bf16 + fp32 master"]}
    ours = [r for r in rows if "peer" in r]
    gpu = all("launches" in r for r in rows)

    def ratio(r: dict[str, Any], key: str) -> float:
        return float(r[key] / peers[r["peer"]][key])

    worst = max(ours, key=lambda r: ratio(r, "loop_us"))
    extra = [
        f"{r['variant'][6:]} {r['arrays'] - peers[r['peer']]['arrays']:+d}"
        for r in ours
        if r["arrays"] != peers[r["peer"]]["arrays"]
    ]
    launches = ""
    if gpu:
        launch = "; ".join(f"{r['variant'][6:]} {ratio(r, 'launches'):.2f}x" for r in ours)
        launches = f"""
On the GPU compiler (one compile-only H100) the kernel launches per step against the matching
peer: {launch}. XLA:GPU drops collectives over a one-device group, which XLA:CPU keeps (one
thunk per parameter per collective at stages 1-3 here), so the CPU loop column overstates what
a GPU host pays at dp = 1."""
    return f"""\
**Reading the numbers.** Each jaxdp variant is held to the bare step with the same precision
(fp32; or bf16 working params with an fp32 master). The state arrays are what each step call
passes in and gets back; a state array costs the host about {res["per_array_us"]:.1f} us here.
Arrays beyond the peer's: {", ".join(extra) if extra else "none"} (stage 1 in fp32 keeps the
replicated working params next to the sharded master: one array per parameter more than a bare
step that updates its params in place). Worst loop ratio: {worst["variant"][6:]},
{ratio(worst, "loop_us"):.2f}x (goal <= 1.2x, on a GPU host; CPU
collectives run synchronously on the calling thread, so these CPU times are a smoke check).
{launches}"""
