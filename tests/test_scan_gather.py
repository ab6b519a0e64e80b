"""jaxdp._src.zero3.scan_gather: inference of scanned stacks, per-layer gather parity, and its HLO
shape."""

from __future__ import annotations

import functools
import math
import re

import chex
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp._src.zero3.scan_gather import (
    find_scanned_axes,
    find_scanned_leaves,
    gather_in_scans,
    per_leaf,
    stacked_by_path,
)

L, D = 4, 8
TOL = {"rtol": 1e-5, "atol": 1e-6}


class Block(linen.Module):
    @linen.compact
    def __call__(self, x, _):
        h = linen.LayerNorm()(x)
        q, k = linen.Dense(D, name="q")(h), linen.Dense(D, name="k")(h)
        att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(D))
        x = x + linen.Dense(D, name="o")(jnp.einsum("bqk,bkd->bqd", att, h))
        h = linen.Dense(2 * D, name="fc")(linen.LayerNorm()(x))
        return x + linen.Dense(D, name="out")(jax.nn.gelu(h)), None


class Linen(linen.Module):
    remat: bool = False
    axis: int = 0

    @linen.compact
    def __call__(self, x):
        x = linen.Dense(D, name="emb")(x)
        block = linen.remat(Block, prevent_cse=False) if self.remat else Block
        stack = linen.scan(
            block, variable_axes={"params": self.axis}, split_rngs={"params": True}, length=L
        )
        x, _ = stack(name="blocks")(x, None)
        return linen.Dense(1, name="head")(x)


def linen_loss(remat=False):
    return _linen_loss(bool(remat))


@functools.cache
def _linen_loss(remat):
    model = Linen(remat)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 3, 5)), jnp.float32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    leaves, treedef = jax.tree.flatten(shapes)

    rng = np.random.default_rng(0)  # no compile (model.init or jax.random cost seconds here)
    params = jax.tree.unflatten(
        treedef,
        [
            jnp.asarray(
                rng.normal(size=s.shape) / math.sqrt(s.shape[-2] if s.ndim > 2 else 4)
            ).astype(s.dtype)
            for s in leaves
        ],
    )
    return (lambda p, xb: jnp.mean(model.apply(p, xb) ** 2)), params, x


@functools.cache
def reference(remat=False):
    """Value and gradient of the unmodified linen loss (compiled once per module)."""
    loss, params, x = linen_loss(remat)
    return jax.jit(jax.value_and_grad(loss))(params, x)


def raw_loss(p, x):
    """Raw lax.scan, reached through jit and checkpoint, with a cast of the whole stack."""

    @jax.jit
    def stack(h, ws, bs):
        body = jax.checkpoint(lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None))
        return jax.lax.scan(body, h, (ws.astype(jnp.float32), bs))[0]

    return jnp.mean((stack(x @ p["emb"], p["w"], p["b"]) @ p["head"]) ** 2)


def raw_params():
    k = jax.random.split(jax.random.key(0), 4)
    p = {
        "b": 0.1 * jax.random.normal(k[0], (L, D)),
        "emb": jax.random.normal(k[1], (5, D)) / 3,
        "head": jax.random.normal(k[2], (D, 2)),
        "w": jax.random.normal(k[3], (L, D, D)) / math.sqrt(D),
    }
    return p, jax.random.normal(jax.random.key(2), (8, 5))


def paths(params, idx):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return sorted(jax.tree_util.keystr(flat[i][0]) for i in idx)


# --- inference ---------------------------------------------------------------------------------


def test_find_raw_scan_through_jit_checkpoint_cast():
    p, x = raw_params()
    assert find_scanned_leaves(raw_loss, p, x) == {0: L, 3: L}  # b, w


def test_find_shape_only():
    p, x = raw_params()
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (p, x))
    assert find_scanned_leaves(raw_loss, *shapes) == {0: L, 3: L}


def test_leaf_used_elsewhere_is_not_reported():
    p, x = raw_params()

    def loss(p, x):
        return raw_loss(p, x) + jnp.sum(p["w"][1] ** 2) + jnp.sum(p["b"].T)

    assert find_scanned_leaves(loss, p, x) == {}


@pytest.mark.parametrize("remat", [False, True])
def test_find_linen_scan(remat):
    loss, params, x = linen_loss(remat)
    found = find_scanned_leaves(loss, params, x)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    want = {i: L for i, (path, _) in enumerate(flat) if "blocks" in jax.tree_util.keystr(path)}
    assert len(want) == 14 and found == want


def test_find_linen_axis_1():
    """nn.scan(variable_axes={"params": 1}) (MaxText's param_scan_axis=1): flax transposes the
    stacks before its scan; inferred as axis 1 (the per-layer transpose that this implies is
    checked for parity in test_parity_marked_axis_1). Shapes only."""
    model = Linen(axis=1)
    x = jax.ShapeDtypeStruct((8, 3, 5), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)

    def loss(p, xb):
        return jnp.mean(model.apply(p, xb) ** 2)

    found = find_scanned_axes(loss, params, x)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    blocks = [i for i, (path, _) in enumerate(flat) if "blocks" in jax.tree_util.keystr(path)]
    assert found == {i: (1, L) for i in blocks}
    assert find_scanned_leaves(loss, params, x) == {}  # axis 0 only


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(self.ln(x)))


class NModel(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Linear(5, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NBlock(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(h, block):
            return block(h)

        return jnp.mean(forward(self.emb(x), self.blocks) ** 2)


def test_find_nnx_vmap_scan():
    graphdef, params = nnx.split(NModel(nnx.Rngs(0)), nnx.Param)
    x = jnp.ones((2, 5))
    found = find_scanned_leaves(lambda p, x: nnx.merge(graphdef, p)(x), params, x)
    assert paths(params, found) == [
        "['blocks']['lin']['bias'].value",
        "['blocks']['lin']['kernel'].value",
        "['blocks']['ln']['bias'].value",
        "['blocks']['ln']['scale'].value",
    ]
    assert set(found.values()) == {L}


def test_stacked_by_path():
    _, params, _ = linen_loss()
    marked = stacked_by_path(params, {r"^params/blocks/": 0, r"head/kernel$": 1})
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    blocks = [i for i, (path, _) in enumerate(flat) if "blocks" in jax.tree_util.keystr(path)]
    assert sorted(i for i, a in marked.items() if a == 0) == blocks
    assert paths(params, [i for i, a in marked.items() if a == 1]) == [
        "['params']['head']['kernel']"
    ]


# --- parity on one device: the "shard" of a layer is the flattened layer -----------------------


def flat_mixed(params, stacked):
    """Per-layer shard arrays [L, n] and the reshape gather for the given {leaf: axis}."""
    leaves, treedef = jax.tree.flatten(params)
    shapes = {}
    for i, ax in stacked.items():
        layers = jnp.moveaxis(leaves[i], ax, 0)
        shapes[i] = layers.shape[1:]
        leaves[i] = layers.reshape(layers.shape[0], -1)
    gather = per_leaf({i: (lambda r, s=s: r.reshape(s)) for i, s in shapes.items()})
    return treedef.unflatten(leaves), gather


def check_parity(loss, params, x, stacked, ref=None, **kw):
    mixed, gather = flat_mixed(params, stacked)
    loss2 = gather_in_scans(loss, stacked, gather, **kw)
    v, g = ref or jax.jit(jax.value_and_grad(loss))(params, x)
    v2, g2 = jax.jit(jax.value_and_grad(loss2))(mixed, x)
    chex.assert_trees_all_close(v2, v, **TOL)
    chex.assert_trees_all_close(g2, flat_mixed(g, stacked)[0], **TOL)


def test_parity_linen_remat():
    """nn.remat inside nn.scan, re-gathered in the backward (remat_gather=False with linen is
    covered under shard_map below)."""
    loss, params, x = linen_loss(True)
    stacked = dict.fromkeys(find_scanned_leaves(loss, params, x), 0)
    check_parity(loss, params, x, stacked, ref=reference(True), remat_gather=True)


def test_parity_raw_and_fallback():
    p, x = raw_params()
    check_parity(raw_loss, p, x, {0: 0, 3: 0}, remat_gather=True)

    def loss(p, x):  # "w" is also indexed directly: gathered whole for that use
        return raw_loss(p, x) + jnp.sum(p["w"][1] ** 2) + jnp.sum(p["b"].T ** 3)

    check_parity(loss, p, x, {0: 0, 3: 0})


def test_custom_vjp_gather():
    """An engine's gather with its own transpose (e.g. fp32 accumulation of the reduce-scatter):
    used per layer, under remat_gather's checkpoint, and under vmap for the whole-stack
    fallback."""
    p, x = raw_params()
    mixed, _ = flat_mixed(p, {0: 0, 3: 0})
    shapes = {0: (D,), 3: (D, D)}
    calls = []

    @jax.custom_vjp
    def unflatten(rows):
        return {i: r.reshape(shapes[i]) for i, r in rows.items()}

    def fwd(rows):
        return unflatten(rows), None

    def bwd(_, ct):
        calls.append(sorted(ct))
        return ({i: c.reshape(-1) for i, c in ct.items()},)

    unflatten.defvjp(fwd, bwd)

    def loss(p, x):
        return raw_loss(p, x) + jnp.sum(p["b"][1] ** 2)

    loss2 = gather_in_scans(loss, {0: 0, 3: 0}, unflatten, remat_gather=True)
    v2, g2 = jax.jit(jax.value_and_grad(loss2))(mixed, x)
    v, g = jax.jit(jax.value_and_grad(loss))(p, x)
    chex.assert_trees_all_close(v2, v, **TOL)
    chex.assert_trees_all_close(g2, flat_mixed(g, {0: 0, 3: 0})[0], **TOL)
    assert [0, 3] in calls and [0] in calls  # the scan's pair per layer; "b" whole, alone


def test_parity_marked_axis_1():
    """A stack kept as [D, L, D] that the model moves to the front before scanning."""
    p, x = raw_params()
    p = {**p, "w": jnp.transpose(p["w"], (1, 0, 2))}

    def loss(p, x):
        return raw_loss({**p, "w": jnp.transpose(p["w"], (1, 0, 2))}, x)

    stacked = stacked_by_path(p, {"^w$": 1, "^b$": 0})
    assert stacked == {0: 0, 3: 1}
    check_parity(loss, p, x, stacked)
    # plus a direct use of the [D, L, D] stack: gathered whole (vmap, out_axes=1) for it
    check_parity(lambda p, x: loss(p, x) + jnp.sum(p["w"][:, 2] ** 2), p, x, stacked)


def test_scan_over_microbatches_then_layers():
    """The stacks are constants of an outer scan (over micro-batches) and xs of the inner one:
    still gathered per layer, inside the inner loop; a constant the outer body uses directly
    ("b" below) is gathered whole once, before the outer loop."""
    p, x = raw_params()

    def accumulate(p, x):
        def micro(acc, xb):
            return acc + raw_loss(p, xb), None

        return jax.lax.scan(micro, 0.0, x.reshape(2, 4, 5))[0]

    assert find_scanned_leaves(accumulate, p, x) == {0: L, 3: L}
    check_parity(accumulate, p, x, {0: 0, 3: 0}, remat_gather=True)

    def direct(p, x):
        def micro(acc, xb):
            return acc + raw_loss(p, xb) + jnp.sum(p["b"] ** 2), None

        return jax.lax.scan(micro, 0.0, x.reshape(2, 4, 5))[0]

    assert find_scanned_leaves(direct, p, x) == {3: L}
    check_parity(direct, p, x, {0: 0, 3: 0})


def test_parity_nnx():
    graphdef, params = nnx.split(NModel(nnx.Rngs(0)), nnx.Param)
    x = jax.random.normal(jax.random.key(3), (2, 5))

    def loss(p, x):
        return nnx.merge(graphdef, p)(x)

    check_parity(loss, params, x, dict.fromkeys(find_scanned_leaves(loss, params, x), 0))


# --- under shard_map over 8 devices: all_gather per layer, psum_scatter transpose ---------------

N = 8


def sharded_setup(remat_gather, mesh=None):
    """The linen loss under shard_map; with ``mesh`` (compile-only devices) the inputs returned
    are abstract. With remat_gather, the model whose block is itself nn.remat (nested
    checkpoints)."""
    loss, params, x = linen_loss(remat=remat_gather)
    stacked = find_scanned_leaves(loss, params, x)
    leaves, treedef = jax.tree.flatten(params)
    abstract = mesh is not None
    mesh = mesh or jax.make_mesh((N,), ("data",))
    shapes, shards = {}, list(leaves)
    for i in stacked:
        shapes[i] = leaves[i].shape[1:]
        n = math.prod(shapes[i])
        flat = leaves[i].reshape(L, n)
        shards[i] = jnp.pad(flat, ((0, 0), (0, -n % N)))

    def gather(rows):
        """Every leaf the scan consumes in one all-gather per layer, as an engine would."""
        keys = sorted(rows)
        packed = jax.lax.all_gather(jnp.concatenate([rows[i] for i in keys]), "data")  # [N, S]
        out, off = {}, 0
        for i in keys:
            w = rows[i].shape[0]
            full = packed[:, off : off + w].reshape(-1)  # rank-major pieces of leaf i
            out[i], off = full[: math.prod(shapes[i])].reshape(shapes[i]), off + w
        return out

    specs = treedef.unflatten(
        [P(None, "data") if i in stacked else P() for i in range(len(leaves))]
    )
    loss2 = gather_in_scans(
        lambda p, xb: loss(p, xb) / N, dict.fromkeys(stacked, 0), gather, remat_gather=remat_gather
    )

    def step(mixed, xb):
        v, g = jax.value_and_grad(loss2)(mixed, xb)
        return jax.lax.psum(v, "data"), g

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs)))
    put = jax.device_put
    if abstract:
        put = lambda a, s: jax.tree.map(  # noqa: E731
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), a, s
        )
    mixed = put(treedef.unflatten(shards), jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    xs = put(x, NamedSharding(mesh, P("data")))
    return f, mixed, xs, (loss, params, x, stacked, shards, treedef)


def hlo_computations(text):
    comps, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m:
            name, comps[m.group(1)] = m.group(1), []
        elif name is not None:
            comps[name].append(line)
    return comps


def loop_bodies(text):
    comps = hlo_computations(text)
    bodies = re.findall(r"while\(.*body=%?([\w.\-]+)", text)
    return comps, [comps[b] for b in bodies]


def all_gathers(lines):
    return [ln for ln in lines if re.search(r"\ball-gather(-start)?\(", ln)]


@pytest.mark.parametrize("remat_gather", [False, True])
def test_sharded(remat_gather):
    """Parity under shard_map (the shard gradient is the reduce-scatter of the full gradient),
    and the compiled program's structure: per-layer all-gathers inside the loops only."""
    f, mixed, xs, (_, _, _, stacked, shards, treedef) = sharded_setup(remat_gather)
    compiled = f.lower(mixed, xs).compile()
    v2, g2 = compiled(mixed, xs)
    v, g = reference(remat_gather)
    gl = jax.tree.leaves(g)
    want = list(gl)
    for i in stacked:  # the reduce-scatter of the full gradient, in the shard layout
        n = math.prod(gl[i].shape[1:])
        want[i] = jnp.pad(gl[i].reshape(L, n), ((0, 0), (0, shards[i].shape[1] - n)))
    chex.assert_trees_all_close(v2, v, **TOL)
    chex.assert_trees_all_close(g2, treedef.unflatten(want), **TOL)

    check_structure(compiled.as_text(), remat_gather, stacked, shards)


def check_structure(text, remat_gather, stacked, shards):
    comps, bodies = loop_bodies(text)
    in_loops = [len(all_gathers(b)) for b in bodies]
    # one all-gather per layer for all 14 leaves, in the forward loop and, with remat_gather,
    # again in the backward loop
    assert sorted(in_loops) == (
        [0] * (len(bodies) - 1) + [1] if not remat_gather else [0] * (len(bodies) - 2) + [1, 1]
    ), in_loops
    body_lines = {id(ln) for b in bodies for ln in b}
    outside = [ln for c in comps.values() for ln in all_gathers(c) if id(ln) not in body_lines]
    assert outside == []
    # the backward loop reduce-scatters each layer's gradient, once (the transpose of the gather)
    scatters = [
        sum(bool(re.search(r"\breduce-scatter(-start)?\(", ln)) for ln in b) for b in bodies
    ]
    assert sorted(scatters)[-1] == 1 and sum(scatters) == 1, scatters
    # peak gathered buffer is one layer: each all-gather result holds exactly one layer of
    # every leaf (padded), never the stack
    layer = sum(s.shape[1] for i, s in enumerate(shards) if i in stacked)  # global widths
    for ln in all_gathers([ln for b in bodies for ln in b]):
        result = ln.split("=", 1)[1].split("all-gather")[0]  # GPU: (operand, result) tuple
        dims = re.findall(r"\w+\[([\d,]*)\]", result)[-1]
        assert int(np.prod([int(d) for d in dims.split(",")])) == layer, (ln, layer)
