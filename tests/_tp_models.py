"""A Megatron-style tensor-parallel block (attention + MLP) and helpers for the 2-D mesh tests."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

D, HEADS, F, T = 16, 4, 32, 4

# Megatron's placement: column split for Q/K/V and the MLP up projection (and its bias), row
# split for the attention output and the MLP down projection; their biases are replicated.
SPECS = {
    "attn": {
        "wq": P(None, "model"),
        "wk": P(None, "model"),
        "wv": P(None, "model"),
        "wo": P("model", None),
        "bo": P(),
    },
    "mlp": {
        "up": P(None, "model"),
        "up_b": P("model"),
        "down": P("model", None),
        "down_b": P(),
    },
}


def tp_params(seed: int = 0):
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)

    def b(n):
        return jnp.asarray(rng.standard_normal((n,)) * 0.1, jnp.float32)

    return {
        "attn": {"wq": w(D, D), "wk": w(D, D), "wv": w(D, D), "wo": w(D, D), "bo": b(D)},
        "mlp": {"up": w(D, F), "up_b": b(F), "down": w(F, D), "down_b": b(D)},
    }


def tp_loss(params, batch):
    x = batch["x"]  # [B, T, D]
    a = params["attn"]
    bsz = x.shape[0]

    def heads(h):
        return h.reshape(bsz, T, HEADS, D // HEADS)

    q, k, v = heads(x @ a["wq"]), heads(x @ a["wk"]), heads(x @ a["wv"])
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(bsz, T, D)
    h = x + o @ a["wo"] + a["bo"]
    m = params["mlp"]
    h = h + jnp.tanh(h @ m["up"] + m["up_b"]) @ m["down"] + m["down_b"]
    return jnp.mean((h - batch["y"]) ** 2)


def tp_batch(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.standard_normal((n, T, D)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((n, T, D)), jnp.float32),
    }


def place(params, mesh, specs=SPECS):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


_COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\(.*?replica_groups=(\{\{[\d,{}]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)"
)


def _ints(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _groups(text: str) -> list[tuple[int, ...]]:
    """Replica groups from HLO text: explicit ``{{0,2},{1,3}}`` or iota ``[2,2]<=[2,2]T(1,0)``."""
    if text.startswith("{{"):
        return [tuple(_ints(g)) for g in re.findall(r"\{([\d,]+)\}", text)]
    m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text.rstrip(","))
    assert m, text
    shape, dims = _ints(m.group(1)), _ints(m.group(2))
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose(_ints(m.group(3)))
    return [tuple(int(d) for d in row) for row in ids.reshape(shape[0], -1)]


def compiled_collectives(text: str):
    """``(op, element_count, replica_groups)`` of every collective in a compiled HLO module."""
    out = []
    for line in text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        shapes = re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1))
        numel = sum(int(np.prod(_ints(sh) or [1])) for sh in shapes)
        out.append((m.group(2), numel, _groups(m.group(3))))
    return out


def lowered_collectives(text: str):
    """``(op, replica_groups)`` of every collective in a lowered StableHLO module."""
    pat = re.compile(
        r"stablehlo\.(all_reduce|reduce_scatter|all_gather|all_to_all)\b.*?"
        r"replica_groups = dense<(\[\[.*?\]\])>"
    )
    out = []
    for line in text.splitlines():
        m = pat.search(line)
        if m:
            groups = [tuple(_ints(g.replace(" ", ""))) for g in re.findall(r"\[([\d, ]+)\]", m[2])]
            out.append((m.group(1), groups))
    return out
