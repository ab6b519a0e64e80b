"""Stage-3 remat policies (``DDPConfig.remat_policy``) compiled for 8 H100s: memory and traffic.

Nothing executes (compile-only H100s, the ``gpu-aot`` extra). For each policy and ``G`` the
step of ``zero_stage=3`` is compiled for 8 H100s and read two ways:

* memory per device from ``compiled.memory_analysis()``: temp bytes, and the total
  argument + output - aliased + temp (as ``bench_memory_gpu.py``);
* memory traffic from the scheduled GPU HLO (GUIDE §4): the bytes read and written by every
  op that is neither a GEMM (a Triton/cuBLAS GEMM fusion or custom call) nor a collective,
  each op counted as its operands' plus its outputs' sizes (an in-place update counts its whole
  buffer, a fusion its whole inputs), loop bodies times their trip count. "model" is the part
  whose ``op_name`` lies under ``jvp(`` (forward, backward and the recomputation in between),
  "all" adds the optimizer update and the rest of the step.

Models: the 16-layer MLP of ``bench_memory_gpu.py`` (4.2M params, 5 buckets) and a GPT of
``jaxdp.models`` at >= 100M params (abstract params from ``jax.eval_shape``), plus, for the
GPT, the GSPMD peer of ``bench_zero3.py`` (plain ``jit``, fp32 master and Adam state sharded
``P("data")``, bf16 working params replicated at use: the params of a whole step alive at
once, as at ZeRO-1).

Run: ``JAX_PLATFORMS=cpu python bench/bench_remat.py [--quick] [--model=mlp|--model=gpt]``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import _harness as H
import jax
import optax
from _models import gpt_problem

from jaxdp import DataParallel, DDPConfig, aot
from jaxdp._src.config.config import REMAT_POLICIES

N = 8
MIB = H.MIB

_COMP = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "after-all",
    "add-dependency",
    "iota",
}
_COLLECTIVE = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "async-",
    "send",
    "recv",
)
_GEMM_KINDS = ('"kind":"__triton_nested_gemm_fusion"', '"kind":"__triton_gemm"', "__cublas")


def _split_shape(rest: str) -> tuple[str, str]:
    """``'<shape> <opcode>(...)...'`` -> (shape text, the rest from the opcode on)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 2 :]
    shape, _, tail = rest.partition(" ")
    return shape, tail


def _operands(tail: str) -> list[str]:
    start = tail.index("(")
    depth = 0
    for i in range(start, len(tail)):
        depth += tail[i] == "("
        depth -= tail[i] == ")"
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", tail[start:i])
    return []


_ELEMENTWISE = {
    "convert",
    "multiply",
    "add",
    "subtract",
    "divide",
    "negate",
    "abs",
    "sqrt",
    "rsqrt",
    "maximum",
    "minimum",
    "select",
    "compare",
    "and",
    "or",
    "not",
}


def _sliced_reads(instrs: list[tuple[str, str, str]]) -> dict[int, int]:
    """Bytes a fused computation reads of those 1-D parameters it reaches only through
    ``slice`` ops, directly or through a 1-D ``concatenate``, and elementwise ops on the same
    index space on the way: the overlap of the slices with each parameter's range (a
    concatenation's other operands, such as zero padding, are computed in the fusion and read
    nothing). A fusion computes each output element from the input elements it indexes, so a
    slice of a (concatenated) buffer reads only the sliced elements: stage 3 feeds the
    optimizer its per-parameter gradients this way, stage 0 unpacks its buckets so.
    Parameters used otherwise are absent (read in full)."""
    info = {}
    users: dict[str, list[str]] = {}
    params: dict[str, int] = {}
    for name, shape, tail in instrs:
        op = tail[: tail.index("(")] if "(" in tail else tail
        ops = _operands(tail) if "(" in tail else []
        info[name] = (op, shape, tail, ops)
        for o in dict.fromkeys(ops):
            users.setdefault(o, []).append(name)
        if op == "parameter":
            params[name] = int(re.search(r"parameter\((\d+)\)", tail).group(1))  # type: ignore[union-attr]

    def one_d(shape: str) -> tuple[str, str] | None:
        dims = H.ARRAY.findall(shape)
        return dims[0] if len(dims) == 1 and "," not in dims[0][1] else None

    out: dict[int, int] = {}
    for name, (op, shape, _tail, ops) in info.items():
        dims = one_d(shape)
        if dims is None:
            continue
        if op == "concatenate":
            # operands: parameters read only here, or values computed in the fusion (padding)
            if not all(users.get(o) == [name] for o in ops if o in params):
                continue
            parts = ops
        elif op == "parameter" and not any(
            info[u][0] == "concatenate" for u in users.get(name, [])
        ):
            parts = [name]
        else:
            continue
        spans: set[tuple[int, int]] = set()
        frontier, seen, ok = [name], {name}, True
        while frontier and ok:
            for u in users.get(frontier.pop(), []):
                uop, ushape, utail, _ = info[u]
                if uop == "slice":
                    hit = re.search(r"slice=\{\[(\d+):(\d+)\]", utail)
                    if hit is None:  # a strided slice
                        ok = False
                        break
                    spans.add((int(hit.group(1)), int(hit.group(2))))
                elif uop in _ELEMENTWISE and (one_d(ushape) or ("", ""))[1] == dims[1]:
                    if u not in seen:
                        seen.add(u)
                        frontier.append(u)
                else:
                    ok = False
                    break
        if not ok or not spans:
            continue
        start = 0
        for o in parts:
            dt, n = H.ARRAY.findall(info[o][1])[0]
            end = start + int(n)
            if o in params:
                got = sum(max(0, min(end, hi) - max(start, lo)) for lo, hi in spans)
                out[params[o]] = min(int(n), got) * H.ITEMSIZE[dt]
            start = end
    return out


def op_name(tail: str, comps: dict[str, list[tuple[str, str, str]]]) -> str:
    """The ``op_name`` of an instruction (``tail``: from its opcode on), or of its fused
    computation's root (else its first instruction with one) when the fusion has none."""
    m = re.search(r'op_name="([^"]*)"', tail)
    if m:
        return m.group(1)
    called = re.search(r"calls=%([\w.\-]+)", tail)
    body = comps.get(called.group(1), []) if called else []
    for _, _, t in [*body[-1:], *body]:  # the root is printed last
        m = re.search(r'op_name="([^"]*)"', t)
        if m:
            return m.group(1)
    return ""


Instr = tuple[str, str, str]  # (name, shape, the rest of the line: opcode, operands, attrs)


def program(text: str) -> tuple[dict[str, list[Instr]], str]:
    """A scheduled HLO module's computations, each a list of :data:`Instr`, and its ENTRY."""
    comps: dict[str, list[Instr]] = {}
    entry, cur = None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = comps.setdefault(m.group(1), [])
            if line.startswith("ENTRY"):
                entry = m.group(1)
            continue
        m = _INSTR.match(line)
        if m and cur is not None:
            shape, tail = _split_shape(m.group(2))
            cur.append((m.group(1), shape, tail))
    assert entry is not None, "no ENTRY computation"
    return comps, entry


def executed(comps: dict[str, list[Instr]], entry: str) -> Iterator[tuple[Instr, str, float]]:
    """Every instruction a step runs, with its opcode and how many times per step: loops'
    bodies counted by their known trip count, calls and conditionals' computations entered,
    the control instructions themselves left out."""

    def walk(comp: str, times: float) -> Iterator[tuple[Instr, str, float]]:
        for ins in comps[comp]:
            tail = ins[2]
            op = tail[: tail.index("(")] if "(" in tail else tail
            if op == "while":
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"', tail)
                body = re.search(r"body=%([\w.\-]+)", tail)
                if body:
                    yield from walk(body.group(1), times * (int(n.group(1)) if n else 1))
                continue
            if op in ("call", "conditional"):
                for c in re.findall(r"(?:to_apply|calls|branch_computations)=\{?%([\w.\-]+)", tail):
                    yield from walk(c, times)
                continue
            yield ins, op, times

    yield from walk(entry, 1.0)


def traffic(text: str, by: Callable[[str], str] | None = None) -> dict[str, float]:
    """Bytes read + written by the non-GEMM, non-collective ops of a scheduled HLO module.

    ``by``: also sum them by ``by(op_name)`` (keys ``"by:<key>"``; :func:`op_name`)."""
    comps, entry = program(text)
    sizes = {name: H.array_bytes(shape) for ins in comps.values() for name, shape, _ in ins}
    out = {"all": 0.0, "model": 0.0, "gemm": 0.0}
    sliced: dict[str, dict[int, int]] = {}  # fused computation -> {param index: bytes read}
    for (_, shape, tail), op, times in executed(comps, entry):
        if op in _FREE or op.startswith(_COLLECTIVE):
            continue
        operands = _operands(tail)
        reads = [sizes.get(o, 0) for o in operands]
        called = re.search(r"calls=%([\w.\-]+)", tail) if op == "fusion" else None
        if called:
            if called.group(1) not in sliced:
                sliced[called.group(1)] = _sliced_reads(comps[called.group(1)])
            for k, b in sliced[called.group(1)].items():
                reads[k] = min(reads[k], b)
        moved = times * (H.array_bytes(shape) + sum(reads))
        if (op == "fusion" and any(k in tail for k in _GEMM_KINDS)) or (
            op == "custom-call" and ("gemm" in tail or "matmul" in tail)
        ):
            out["gemm"] += moved
            continue
        out["all"] += moved
        if "jvp(" in tail:
            out["model"] += moved
        if by is not None:
            key = "by:" + by(op_name(tail, comps))
            out[key] = out.get(key, 0.0) + moved
    return out


def _reading(compiled: Any, psi: int) -> dict[str, float]:
    m = compiled.memory_analysis()
    t = traffic(compiled.as_text())
    return {
        "temp MiB": m.temp_size_in_bytes / MIB,
        "total MiB": H.total_bytes(m) / MIB,
        "total B/param": H.total_bytes(m) / psi,
        "traffic MiB": t["all"] / MIB,
        "model traffic MiB": t["model"] / MIB,
        "model traffic B/param": t["model"] / psi,
    }


def mlp_problem(quick: bool) -> tuple[Any, Any, Any, dict[str, Any]]:
    layers, width, batch = (4, 128, 64) if quick else (16, 512, 256)
    loss_fn, params, data = aot.example_mlp(layers=layers, width=width, batch=batch)
    what = (
        f"{layers}-layer tanh MLP of width {width} (`jaxdp.aot.example_mlp`), global batch {batch}"
    )
    return loss_fn, params, data, {"what": what, "bucket_size": 20_000 if quick else 1_000_000}


def _peer(loss_fn: Any, params: Any, batch: Any, g: int, mesh: Any, psi: int) -> dict[str, Any]:
    from bench_zero3 import compile_peer

    return _reading(compile_peer(loss_fn, optax.adamw(1e-4), g, mesh, params, batch)[0], psi)


def run(model: str, quick: bool = False, gs: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    mesh = aot.h100_mesh(N)
    rows = []
    info: dict[str, Any] = {}
    for g in gs:
        if model == "mlp":
            loss_fn, params, batch, info = mlp_problem(quick)
        else:
            loss_fn, params, batch, info = gpt_problem(quick, g, N)
        psi = sum(x.size for x in jax.tree.leaves(params))
        for policy in REMAT_POLICIES:
            cfg = DDPConfig(
                zero_stage=3,
                num_microbatches=g,
                param_dtype="bfloat16",
                bucket_size=info["bucket_size"],
                remat_policy=policy,
            )
            dp = DataParallel(loss_fn, optax.adamw(1e-4), cfg, mesh=mesh)
            t0 = time.perf_counter()
            compiled = aot.compile_step(dp, params, batch)
            row = {"program": f"stage 3, {policy}", "G": g, **_reading(compiled, psi)}
            row["compile s"] = time.perf_counter() - t0
            rows.append(row)
            print(row, flush=True)
        if model == "gpt":
            t0 = time.perf_counter()
            row = {"program": "GSPMD peer", "G": g, **_peer(loss_fn, params, batch, g, mesh, psi)}
            row["compile s"] = time.perf_counter() - t0
            rows.append(row)
            print(row, flush=True)
    return {"model": model, "psi": psi, "what": info["what"], "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    keys = [
        "temp MiB",
        "total MiB",
        "total B/param",
        "traffic MiB",
        "model traffic MiB",
        "model traffic B/param",
    ]
    lines = [
        f"{res['what']}, Ψ = {res['psi']:,}, bf16 working params, fp32 master, AdamW, "
        "8 compile-only H100s, jaxdp's XLA flags.",
        "",
        "| program | G | " + " | ".join(keys) + " | compile s |",
        "|---|---:|" + "---:|" * (len(keys) + 1),
    ]
    for r in res["rows"]:
        vals = " | ".join(f"{r[k]:.2f}" for k in keys)
        lines.append(f"| {r['program']} | {r['G']} | {vals} | {r['compile s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    models = [a.split("=", 1)[1] for a in argv if a.startswith("--model=")] or ["mlp", "gpt"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    for model in models:
        print(markdown(run(model, quick)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
