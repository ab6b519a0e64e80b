"""BucketLayout: Megatron's cases (reference/megatron-ddp.md section 7.3) and properties."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdp import (
    BucketLayout,
    DDPConfig,
    bucket_end_divisor,
    pad_bucket_end,
    pad_param_start,
    pad_to_divisor,
)


def make_params(shapes, dtype=jnp.float32):
    """Leaves p0, p1, ... in registration order (a list keeps the order)."""
    return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


def megatron(shapes, dp, bucket_size=None, own=(), busbw=False):
    cfg = DDPConfig(
        zero_stage=1,
        bucket_size=bucket_size,
        bucket_layout="megatron",
        pad_buckets_for_high_nccl_busbw=busbw,
        own_bucket_param_patterns=tuple(str(i) for i in own),
    )
    return BucketLayout.from_params(make_params(shapes), cfg, dp)


def default(shapes, bucket_size=None, dp=2):
    cfg = DDPConfig(zero_stage=0, bucket_size=bucket_size)
    return BucketLayout.from_params(make_params(shapes), cfg, dp)


def ranges(layout):
    return [(s.start, s.end, s.bucket) for s in layout.slots]


def buckets(layout):
    return [(b.start, b.end) for b in layout.buckets]


def unpadded(layout):
    return [b.numel_unpadded for b in layout.buckets]


# ---------------------------------------------------------------- padding helpers (7.3)
def test_padding_helpers():
    assert pad_to_divisor(128, 64) == 128
    assert pad_to_divisor(65, 64) == 128
    assert pad_to_divisor(0, 64) == 0
    assert [pad_param_start(i) for i in (0, 1, 63, 64, 65)] == [0, 64, 64, 64, 128]
    assert pad_bucket_end(1, 4) == 128
    assert pad_bucket_end(1, 4, True) == 65536
    assert pad_bucket_end(128, 2) == 128
    assert bucket_end_divisor(3) == 384
    assert bucket_end_divisor(256) == 256
    with pytest.raises(ValueError, match="divisor must be positive"):
        pad_to_divisor(3, 0)


# ---------------------------------------------------------------- default layout (7.3)
def test_default_layout_cases():
    lay = default([(100, 100), (50, 50)])
    assert ranges(lay) == [(2500, 12500, 0), (0, 2500, 0)]
    assert buckets(lay) == [(0, 12500)] and unpadded(lay) == [12500]
    assert unpadded(default([(100, 100)] * 3, bucket_size=15000)) == [20000, 10000]
    assert buckets(default([(97,), (103,)])) == [(0, 200)]
    assert ranges(default([(256,)])) == [(0, 256, 0)]


# ---------------------------------------------------------------- distributed optimizer (7.3)
def test_megatron_small_params_dp2():
    lay = megatron([(97,), (103,)], dp=2)
    assert ranges(lay) == [(128, 225, 0), (0, 103, 0)]
    assert buckets(lay) == [(0, 256)] and unpadded(lay) == [225]


def test_megatron_dp4_and_busbw_and_dp8():
    lay = megatron([(1000,), (1000,)], dp=4)
    assert ranges(lay) == [(1024, 2024, 0), (0, 1000, 0)]
    assert buckets(lay) == [(0, 2048)]
    assert buckets(megatron([(1000,)], dp=2, busbw=True)) == [(0, 65536)]
    assert buckets(megatron([(1000,)], dp=8)) == [(0, 1024)]


def test_megatron_shared_embedding_last():
    lay = megatron([(1000,), (1000,)], dp=2, own=(1,))  # [regular, shared]
    assert ranges(lay) == [(1024, 2024, 1), (0, 1000, 0)]
    assert buckets(lay) == [(0, 1024), (1024, 2048)]
    assert unpadded(lay) == [1000, 1000]


def test_megatron_shared_embedding_first_quirk():
    lay = megatron([(1000,), (1000,)], dp=2, own=(0,))  # [shared, regular]
    assert ranges(lay) == [(1024, 2024, 1), (0, 1000, 0)]
    # Megatron closes the open bucket at the shared param's aligned start: 1024, not 1000.
    assert unpadded(lay) == [1024, 1000]


def test_megatron_bucket_size_8000():
    lay = megatron([(5000,)] * 3, dp=2, bucket_size=8000)
    assert ranges(lay) == [(10112, 15112, 1), (5056, 10056, 0), (0, 5000, 0)]
    assert buckets(lay) == [(0, 10112), (10112, 15232)]
    assert unpadded(lay) == [10056, 5000]


def test_megatron_three_regular_plus_shared():
    lay = megatron([(5000,)] * 4, dp=2, bucket_size=8000, own=(3,))
    assert buckets(lay) == [(0, 5120), (5120, 15232), (15232, 20352)]
    assert unpadded(lay) == [5000, 10056, 5000]
    assert lay.buckets[0].param_paths == ("3",)


def test_megatron_64_multiples_match_default_offsets():
    shapes = [(640,), (1280,), (960,)]
    lay = megatron(shapes, dp=1)
    assert ranges(lay) == ranges(default(shapes, dp=1))
    assert ranges(lay) == [(2240, 2880, 0), (960, 2240, 0), (0, 960, 0)]
    assert buckets(lay) == [(0, 2944)]


def test_megatron_dp3_bucket_end():
    assert buckets(megatron([(1000,)], dp=3)) == [(0, 1152)]
    assert buckets(megatron([(1000,)], dp=256)) == [(0, 1024)]


def test_megatron_testmodel_worked_example():
    # TestModel(100, 100, num_layers=2, bias=True): [w0, b0, w1, b1] (reference 2.6, 7.2).
    shapes = [(100, 100), (100,), (100, 100), (100,)]
    for dp in (1, 2, 4, 8, 16, 64, 128):
        lay = megatron(shapes, dp=dp)
        assert ranges(lay) == [(10304, 20304, 0), (10176, 10276, 0), (128, 10128, 0), (0, 100, 0)]
        assert buckets(lay) == [(0, 20352)] and unpadded(lay) == [20304]
    lay = megatron([(100, 100), (100,)] * 10, dp=8)
    assert buckets(lay) == [(0, 101760)] and unpadded(lay) == [101712]


# ---------------------------------------------------------------- grouping and structure
def test_buffers_grouped_by_dtype_in_first_appearance_order():
    params = {
        "a": jax.ShapeDtypeStruct((10,), jnp.bfloat16),
        "b": jax.ShapeDtypeStruct((20,), jnp.float32),
        "c": jax.ShapeDtypeStruct((30,), jnp.bfloat16),
    }
    lay = BucketLayout.from_params(params, DDPConfig(), dp_size=4)
    assert [(b.dtype, b.grad_dtype) for b in lay.buffers] == [
        ("bfloat16", "bfloat16"),
        ("float32", "float32"),
    ]
    assert lay.buckets[0].param_paths == ("c", "a")
    fp32 = BucketLayout.from_params(params, DDPConfig(grad_reduce_in_fp32=True), dp_size=4)
    assert [b.grad_dtype for b in fp32.buffers] == ["float32", "float32"]
    cast = BucketLayout.from_params(params, DDPConfig(param_dtype="bfloat16"), dp_size=4)
    assert len(cast.buffers) == 1 and cast.buffers[0].dtype == "bfloat16"


def test_layout_is_hashable_and_static():
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}
    a = BucketLayout.from_params(params, DDPConfig(zero_stage=1), 4)
    b = BucketLayout.from_params(jax.eval_shape(lambda: params), DDPConfig(zero_stage=1), 4)
    assert a == b and hash(a) == hash(b)

    @jax.jit
    def roundtrip(tree):
        return a.unpack(a.pack(tree))

    out = roundtrip(params)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), out, params))


def test_flax_params_paths_and_own_bucket():
    import flax.linen as nn

    class Tied(nn.Module):
        @nn.compact
        def __call__(self, x):
            emb = nn.Embed(50, 16, name="embed")
            h = emb(x)
            h = nn.Dense(16, name="mlp")(h)
            return emb.attend(h)

    params = jax.eval_shape(Tied().init, jax.random.key(0), jnp.zeros((2, 3), jnp.int32))
    cfg = DDPConfig(zero_stage=1, bucket_size=None, own_bucket_param_patterns=("embed/*",))
    lay = BucketLayout.from_params(params["params"], cfg, 8)
    paths = {s.path for s in lay.slots}
    assert paths == {"embed/embedding", "mlp/bias", "mlp/kernel"}
    owner = [b for b in lay.buckets if "embed/embedding" in b.param_paths]
    assert len(owner) == 1 and owner[0].param_paths == ("embed/embedding",)
    assert "bucket" in lay.summary() and "pad %" in lay.summary()


def test_errors_are_clear():
    cfg = DDPConfig()
    with pytest.raises(ValueError, match=r"dp_size=0; expected an int >= 1"):
        BucketLayout.from_params({"w": jnp.ones(3)}, cfg, 0)
    with pytest.raises(TypeError, match=r"expected a jaxdp\.DDPConfig"):
        BucketLayout.from_params({"w": jnp.ones(3)}, {"zero_stage": 1}, 2)
    with pytest.raises(TypeError, match=r"leaf 'step' has dtype int32"):
        BucketLayout.from_params({"w": jnp.ones(3), "step": jnp.int32(0)}, cfg, 2)
    with pytest.raises(TypeError, match=r"leaf 'lr' is a float"):
        BucketLayout.from_params({"w": jnp.ones(3), "lr": 0.1}, cfg, 2)
    with pytest.raises(ValueError, match="has no array leaves"):
        BucketLayout.from_params({}, cfg, 2)
    lay = BucketLayout.from_params({"w": jnp.ones(3)}, cfg, 2)
    with pytest.raises(ValueError, match="tree structure"):
        lay.pack({"v": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"leaf 'w' has shape \(4,\); expected \(3,\)"):
        lay.pack({"w": jnp.ones(4)})
    with pytest.raises(ValueError, match="expected a sequence of 1"):
        lay.unpack(jnp.ones(3))
    with pytest.raises(ValueError, match=r"expected \(3,\)"):
        lay.unpack((jnp.ones(4),))
    with pytest.raises(KeyError, match="no parameter at path 'x'"):
        lay.param_range("x")


# ---------------------------------------------------------------- properties (hypothesis)
shapes_st = st.lists(
    st.lists(st.integers(1, 40), min_size=0, max_size=3).map(tuple), min_size=1, max_size=12
)


def _xla_cpu_runs_float16() -> bool:
    """Whether this backend can round to float16.

    XLA:CPU lowers float32 -> float16 to ``__truncsfhf2``, a runtime function its JIT does not
    provide; only CPUs with F16C (AVX2-class x86, and any run not capped below it with
    ``--xla_cpu_max_isa``) convert inline. Elsewhere no float16 program compiles
    (openxla/xla#6787), whatever jaxdp does.
    """
    try:
        jax.block_until_ready(jax.jit(lambda x: x.astype(jnp.float16))(jnp.ones(2)))
    except jax.errors.JaxRuntimeError:
        return False
    return True


FLOAT16 = _xla_cpu_runs_float16()
_DTYPES = ["float32", "bfloat16"] + (["float16"] if FLOAT16 else [])
dtypes_st = st.lists(st.sampled_from(_DTYPES), min_size=1, max_size=12)


@pytest.mark.skipif(not FLOAT16, reason="XLA:CPU cannot round to float16 without F16C")
@pytest.mark.parametrize("kind", ["interleaved", "megatron"])
def test_float16_buckets_round_trip(kind):
    """float16 leaves (the property test below mixes them in only where the CPU can)."""
    cfg = DDPConfig(zero_stage=1, bucket_size=40, bucket_layout=kind)
    params = [
        jnp.linspace(-3, 3, n, dtype=jnp.float16).reshape(s) for n, s in [(1, ()), (30, (5, 6))]
    ]
    params.append(jnp.arange(7, dtype=jnp.float32))
    lay = BucketLayout.from_params(params, cfg, 3)
    for p, q in zip(params, lay.unpack(lay.pack(params))):
        assert p.dtype == q.dtype
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))


@settings(max_examples=60, deadline=None)
@given(
    shapes=shapes_st,
    dtypes=dtypes_st,
    dp=st.sampled_from([1, 2, 3, 4, 6, 8, 16, 64]),
    bucket_size=st.one_of(st.none(), st.integers(1, 3000)),
    stage=st.sampled_from([0, 1, 2, 3]),
    kind=st.sampled_from(["interleaved", "megatron"]),
    busbw=st.booleans(),
    own=st.sets(st.integers(0, 11), max_size=2),
    seed=st.integers(0, 2**31 - 1),
)
def test_layout_properties(shapes, dtypes, dp, bucket_size, stage, kind, busbw, own, seed):
    busbw = busbw and stage > 0
    cfg = DDPConfig(
        zero_stage=stage,
        bucket_size=bucket_size,
        bucket_layout=kind,
        pad_buckets_for_high_nccl_busbw=busbw,
        own_bucket_param_patterns=tuple(str(i) for i in own),
    )
    rng = np.random.default_rng(seed)
    params = [
        jnp.asarray(rng.standard_normal(s), dtype=dtypes[i % len(dtypes)])
        for i, s in enumerate(shapes)
    ]
    lay = BucketLayout.from_params(params, cfg, dp)
    assert len(lay.slots) == len(params)

    # pack and unpack are exact inverses, bitwise.
    flat = lay.pack(params)
    back = lay.unpack(flat)
    for p, q in zip(params, back):
        assert p.dtype == q.dtype and p.shape == q.shape
        np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(q, np.float32))
    again = lay.pack(back)
    for a, b in zip(flat, again):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    # Every element is owned exactly once; padding is zero.
    marker = [
        jnp.arange(1, p.size + 1, dtype=jnp.float32).reshape(p.shape) + 1e5 * i
        for i, p in enumerate(params)
    ]
    packed = lay.pack(marker, dtype=jnp.float32)
    vals = np.concatenate([np.asarray(x) for x in packed])
    nonzero = np.sort(vals[vals != 0])
    expected = np.sort(np.concatenate([np.ravel(np.asarray(m)) for m in marker]))
    np.testing.assert_array_equal(nonzero, expected)

    for buf in lay.buffers:
        assert buf.numel == sum(lay.buckets[i].numel for i in buf.buckets)
    for b in lay.buckets:
        assert b.numel_params <= b.numel_unpadded <= b.numel
        if lay.kind == "contiguous":
            assert b.numel == b.numel_unpadded == b.numel_params
            continue
        # Shards are equal across ranks and aligned for the collective.
        assert b.numel % dp == 0 and b.shard_numel * dp == b.numel
        div = bucket_end_divisor(dp, busbw)
        assert b.numel % div == 0
        assert b.numel - b.numel_unpadded < div
        per_param = 64 if lay.kind == "megatron" else dp
        # Padding bound: < per_param per parameter (alignment or split), < div at the end.
        assert b.numel - b.numel_params < per_param * len(b.slots) + div
        for i in b.slots:
            s = lay.slots[i]
            if lay.kind == "megatron":
                assert s.start % 64 == 0 and s.end - s.start == s.size
            else:
                assert (s.end - s.start) == math.ceil(s.size / dp)

    # Megatron bucket-closing rule: every bucket but a buffer's last reached bucket_size,
    # or ends at an own-bucket parameter.
    own_paths = {str(i) for i in own}
    for buf in lay.buffers:
        for j in buf.buckets[:-1]:
            b = lay.buckets[j]
            nxt = lay.buckets[j + 1]
            own_split = bool(own_paths & set(b.param_paths)) or bool(
                own_paths & set(nxt.param_paths[:1])
            )
            assert own_split or (bucket_size and b.numel_unpadded >= bucket_size), b
