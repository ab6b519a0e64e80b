"""Step time of jaxdp.DataParallel against plain ``jax.jit`` data parallelism, in one process.

Model: a flax MLP (6 Dense 512x512 layers + a 512x16 head, ~1.6M float32 params), MSE loss,
AdamW, global batch 256 x 512, on 8 simulated CPU devices. Every variant is compiled first
(compile time reported separately: ``lower(state, batch).compile()``), warmed up, then timed
round-robin: each round runs every variant for ``inner`` steps and blocks on the new state
(``block_until_ready``), so slow drift of the machine hits all variants alike. The reported time
is the median over rounds, per step. All states are donated.

Variants:

* ``jaxdp default``: ``DataParallel`` with ``DDPConfig()`` (stage 0, bucket_size "auto", which
  is one bucket for this model);
* ``plain jit``: params and optimizer state replicated (``NamedSharding(mesh, P())``), batch
  sharded ``P('data')``, ``jax.grad`` of the mean loss + optax update; XLA's SPMD partitioner
  inserts the gradient all-reduce;
* ``shard_map pmean``: the naive peer, per-device gradients (w.r.t. a varying copy of the
  params) and one ``pmean`` per leaf inside ``shard_map``, optax update outside;
* a control: plain jit on the same network with every kernel stored transposed, ``[out, in]``
  (same math, same numbers; see BENCHMARKS.md for why it matters on the CPU backend);
* extra jaxdp rows: ZeRO-1, gradient accumulation (G=4) at stages 0, 1, 2, several buckets.

The CPU backend runs collectives as synchronous rendezvous of the device threads (no overlap),
so absolute times say nothing about a GPU; only ratios measured here, in one process, mean
something. Run: python bench/bench_step.py
"""

from __future__ import annotations

import os

import _harness as H

os.environ.update(H.cpu_devices(8))

import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _models import DEPTH, MLP, OUT, WIDTH, mse_loss, regression_data
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdp

BATCH = 256
SMALL_BUCKET = 300_000


def transposed_loss(params, batch):
    """The MLP above with kernels stored ``[out, in]`` (``x @ W.T``): same math."""
    x = batch["x"]
    for i in range(len(params) - 1):
        p = params[f"dense_{i}"]
        x = jax.nn.relu(jnp.einsum("bi,oi->bo", x, p["kernel"]) + p["bias"])
    p = params["head"]
    pred = jnp.einsum("bi,oi->bo", x, p["kernel"]) + p["bias"]
    return jnp.mean((pred - batch["y"]) ** 2)


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-3, weight_decay=1e-4)


_COLLECTIVE = re.compile(r"= \S.*? (all-reduce|reduce-scatter|all-gather|all-to-all)\(")
_TRANSPOSE = re.compile(r" transpose\(")


def hlo_facts(text: str) -> str:
    """Static counts in the compiled HLO: collectives by kind, and explicit transposes."""
    kinds = Counter(m.group(1) for m in _COLLECTIVE.finditer(text))
    parts = [f"{n} {k}" for k, n in sorted(kinds.items())]
    parts.append(f"{len(_TRANSPOSE.findall(text))} transpose")
    return ", ".join(parts)


@dataclass
class Variant:
    """A step function with its state; ``step(state, batch) -> (state, metrics)``."""

    name: str
    step: Callable[[Any, Any], Any]
    state: Any
    batch: Any
    note: str = ""
    compile_s: float = float("nan")
    hlo: str = ""
    times: list[float] = field(default_factory=list)

    def compile(self) -> Variant:
        t0 = time.perf_counter()
        compiled = self.step.lower(self.state, self.batch).compile()  # type: ignore[attr-defined]
        self.compile_s = time.perf_counter() - t0
        self.hlo = hlo_facts(compiled.as_text())
        return self

    def run(self, n: int) -> None:
        state = self.state
        for _ in range(n):
            state, _ = self.step(state, self.batch)
        jax.block_until_ready(state)
        self.state = state


# ---------------------------------------------------------------------- variants
def jaxdp_variant(name: str, params, data, loss_fn, mesh, note: str = "", **cfg) -> Variant:
    dp = jaxdp.DataParallel(loss_fn, optimizer(), jaxdp.DDPConfig(**cfg), mesh=mesh)
    state = dp.init(params)
    nb = len(dp.layout.buckets)
    desc = f"{nb} bucket{'s' if nb > 1 else ''}"
    return Variant(name, dp.step, state, dp.shard_batch(data), f"{desc}; {note}".strip("; "))


def plain_jit_variant(name: str, params, data, loss_fn, mesh, note: str) -> Variant:
    opt = optimizer()
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    state = jax.device_put((params, opt.init(params)), rep)
    state_sh = jax.tree.map(lambda _: rep, state)
    jitted = jax.jit(step, donate_argnums=(0,), out_shardings=(state_sh, rep))
    return Variant(name, jitted, state, jax.device_put(data, shard), note)


def pmean_variant(params, data, loss_fn, mesh) -> Variant:
    opt = optimizer()
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def local(params, batch):
        # A varying copy so that autodiff gives per-device partial gradients (no implicit psum).
        wv = jax.tree.map(lambda w: jax.lax.pcast(w, "data", to="varying"), params)
        loss, grads = jax.value_and_grad(loss_fn)(wv, batch)
        grads = jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads)
        return grads, jax.lax.pmean(loss, "data")

    grad_fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))

    def step(state, batch):
        params, opt_state = state
        grads, loss = grad_fn(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    state = jax.device_put((params, opt.init(params)), rep)
    state_sh = jax.tree.map(lambda _: rep, state)
    jitted = jax.jit(step, donate_argnums=(0,), out_shardings=(state_sh, rep))
    n = len(jax.tree.leaves(params))
    return Variant(
        "shard_map per-leaf pmean (peer)",
        jitted,
        state,
        jax.device_put(data, shard),
        f"{n} pmeans, combined by XLA",
    )


def build_variants(mesh) -> list[Variant]:
    model = MLP()
    loss_fn = mse_loss(model)
    data = regression_data(BATCH)
    params = model.init(jax.random.key(0), jnp.zeros((1, WIDTH)))["params"]

    def fresh(transpose: bool = False):  # donation consumes the params, so copy them each time
        return jax.tree.map(lambda x: jnp.array(x.T if transpose else x), params)

    assert np.allclose(loss_fn(params, data), transposed_loss(fresh(True), data), rtol=1e-5)
    out = [
        jaxdp_variant("jaxdp default, DDPConfig()", fresh(), data, loss_fn, mesh, "stage 0"),
        plain_jit_variant(
            "plain jit (NamedSharding)", fresh(), data, loss_fn, mesh, "XLA-inserted all-reduce"
        ),
        pmean_variant(fresh(), data, loss_fn, mesh),
        plain_jit_variant(
            "control: plain jit, kernels [out, in]",
            fresh(True),
            data,
            transposed_loss,
            mesh,
            "same math, transposed storage",
        ),
        jaxdp_variant("jaxdp zero_stage=1", fresh(), data, loss_fn, mesh, zero_stage=1),
        jaxdp_variant(
            f"jaxdp stage 0, bucket_size={SMALL_BUCKET:,}",
            fresh(),
            data,
            loss_fn,
            mesh,
            bucket_size=SMALL_BUCKET,
        ),
        jaxdp_variant("jaxdp stage 0, G=4", fresh(), data, loss_fn, mesh, num_microbatches=4),
        jaxdp_variant(
            "jaxdp zero_stage=1, G=4",
            fresh(),
            data,
            loss_fn,
            mesh,
            zero_stage=1,
            num_microbatches=4,
        ),
        jaxdp_variant(
            "jaxdp zero_stage=2, G=4",
            fresh(),
            data,
            loss_fn,
            mesh,
            "reduce-scatter per micro-batch",
            zero_stage=2,
            num_microbatches=4,
        ),
    ]
    return [v.compile() for v in out]


def measure(variants: list[Variant], rounds: int, inner: int, warmup: int) -> None:
    """Paired rounds after warm-up (the first call also compiles through jit's own cache)."""
    times = H.rounds({v.name: v.run for v in variants}, rounds, inner, warmup)
    for v in variants:
        v.times = times[v.name]


def _med(v: Variant) -> float:
    return H.median(v.times)


def _cells(v: Variant, ref: float) -> list[str]:
    """Name, median ms, min-max ms and the median over ``ref``."""
    spread = f"{1e3 * min(v.times):.1f}-{1e3 * max(v.times):.1f}"
    return [v.name, f"{1e3 * _med(v):.1f}", spread, f"{_med(v) / ref:.2f}x"]


def table(variants: list[Variant], rounds: int, inner: int) -> str:
    ref = _med(variants[1])
    ctrl = _med(variants[3])
    head = ["variant", "ms/step (median)", "min-max ms", "÷ plain jit", "÷ control"]
    head += ["compile s", "compiled HLO (static counts)", "notes"]
    rows = [
        [*_cells(v, ref), f"{_med(v) / ctrl:.2f}x", f"{v.compile_s:.2f}", v.hlo, v.note]
        for v in variants
    ]
    lines = [
        H.table(head, rows, "lrrrrrll"),
        "",
        f"Median over {rounds} rounds of {inner} steps each (per-step time = round time / "
        f"{inner}), variants interleaved round-robin after warm-up. Compile time is "
        "`jit(...).lower(state, batch).compile()` alone (tracing + lowering + XLA). "
        "G = `num_microbatches` (same global batch, so 4 smaller matmuls per device).",
    ]
    return "\n".join(lines)


def single_device(rounds: int, inner: int, warmup: int) -> tuple[str, dict[str, float]]:
    """The default and several-bucket jaxdp steps on ONE device (per-device batch, no
    collective partner): separates their compute from the 8-thread rendezvous."""
    mesh = jaxdp.make_mesh(jax.devices()[:1])
    model = MLP()
    loss_fn = mse_loss(model)
    data = regression_data(BATCH // 8)
    params = model.init(jax.random.key(0), jnp.zeros((1, WIDTH)))["params"]
    variants = [
        jaxdp_variant(name, jax.tree.map(jnp.array, params), data, loss_fn, mesh, **cfg)
        for name, cfg in (
            ("jaxdp default, DDPConfig()", {}),
            (f"jaxdp stage 0, bucket_size={SMALL_BUCKET:,}", {"bucket_size": SMALL_BUCKET}),
        )
    ]
    measure(variants, rounds, inner, warmup)
    ref = _med(variants[0])
    lines = [
        f"Same two steps on **one** device, batch {BATCH // 8}x{WIDTH} (one rank's share):",
        "",
        H.table(
            ["variant (dp=1)", "ms/step (median)", "min-max ms", "÷ default"],
            [_cells(v, ref) for v in variants],
        ),
    ]
    return "\n".join(lines), {v.name: _med(v) for v in variants}


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    rounds, inner, warmup = (2, 1, 1) if quick else (15, 2, 3)
    mesh = jaxdp.make_mesh()
    if mesh.shape["data"] != 8:
        raise RuntimeError(f"expected 8 devices, got {dict(mesh.shape)}; set XLA_FLAGS first")
    variants = build_variants(mesh)
    n_params = sum(x.size for x in jax.tree.leaves(variants[1].state[0]))
    measure(variants, rounds, inner, warmup)
    ratio = _med(variants[0]) / _med(variants[1])
    ratio_ctrl = _med(variants[0]) / _med(variants[3])
    verdict = "meets" if ratio <= 0.8 else "does NOT meet"
    summary = (
        f"Model: flax MLP {DEPTH}x Dense({WIDTH}) + Dense({OUT}) head, {n_params:,} float32 "
        f"params, AdamW, global batch {BATCH}x{WIDTH}, dp=8 (simulated CPU devices).\n\n"
        f"**Default jaxdp / plain jit = {ratio:.2f}x**: {verdict} the acceptance target "
        f"(<= 0.8x). Against the transposed-storage control (the plain jit program without "
        f"the CPU transpose penalty explained below) it is **{ratio_ctrl:.2f}x**, and the "
        f"naive shard_map peer is {_med(variants[2]) / _med(variants[1]):.2f}x of plain jit."
    )
    one_md, one = single_device(rounds, inner, warmup)
    md = summary + "\n\n" + table(variants, rounds, inner) + "\n\n" + one_md
    print(md)
    return {
        "markdown": md,
        "ratio": ratio,
        "ratio_control": ratio_ctrl,
        "rows": {v.name: (_med(v), v.compile_s) for v in variants},
        "spread": {v.name: (min(v.times), max(v.times)) for v in variants},
        "single_device": one,
    }


def reading(res: dict[str, Any]) -> str:
    rows = res["rows"]

    def ms(name: str) -> float:
        return next(v for k, v in rows.items() if k.startswith(name))[0]

    plain, ctrl, peer = ms("plain jit"), ms("control"), ms("shard_map per-leaf pmean")
    g4_0, g4_2 = ms("jaxdp stage 0, G=4"), ms("jaxdp zero_stage=2, G=4")
    small, default = ms("jaxdp stage 0, bucket_size"), ms("jaxdp default")
    lo, hi = next(v for k, v in res["spread"].items() if k.startswith("jaxdp stage 0, bucket"))
    one = list(res["single_device"].values())
    return H.reading(
        "bench_step",
        ctrl_ms=1e3 * ctrl,
        plain_ms=1e3 * plain,
        vs_ctrl=default / ctrl,
        vs_peer=default / peer,
        small_bucket=SMALL_BUCKET,
        one=one[1] / one[0],
        small=small / default,
        lo_ms=1e3 * lo,
        hi_ms=1e3 * hi,
        g4=g4_0 / default,
        g4_2=g4_2 / g4_0,
    )


if __name__ == "__main__":
    result()
