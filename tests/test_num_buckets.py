"""``DDPConfig.num_buckets``: k buckets of about equal size per buffer (Megatron's alternative
to ``bucket_size``), its errors, the combine thresholds it implies, and engine parity."""

import itertools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_batch, max_rel_err, mlp_params, mse_loss, reference_train, train_steps

from jaxdp import BucketLayout, DataParallel, DDPConfig, combine_thresholds, make_mesh

# Three models: equal layers, a GPT-like mix of shapes (embedding, qkv, mlp, norms), and
# two buffers (a float32 head next to bfloat16 layers).
EQUAL = {f"l{i}": {"w": (64, 48), "b": (48,)} for i in range(10)}
GPTISH = {
    "embed": (256, 32),
    **{
        f"block{i}": {"qkv": (32, 96), "proj": (32, 32), "up": (32, 128), "down": (128, 32)}
        for i in range(4)
    },
    "norm": (32,),
}


def shapes_of(tree, dtype=jnp.float32):
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), tree, is_leaf=lambda x: isinstance(x, tuple)
    )


def two_buffers():
    return {"head": shapes_of({"w": (32, 40)}), "body": shapes_of(EQUAL, jnp.bfloat16)}


MODELS = {"equal": lambda: shapes_of(EQUAL), "gpt": lambda: shapes_of(GPTISH), "two": two_buffers}
KINDS = {"contiguous": {}, "interleaved": {"zero_stage": 1}, "megatron": {"zero_stage": 1}}


def layout_of(model, kind, k, dp, **extra):
    cfg = DDPConfig(
        **KINDS[kind],
        **({"bucket_layout": "megatron"} if kind == "megatron" else {}),
        num_buckets=k,
        **extra,
    )
    return BucketLayout.from_params(MODELS[model](), cfg, dp)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dp", [3, 8])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_k_buckets_of_about_equal_size_per_buffer(model, kind, dp, k):
    lay = layout_of(model, kind, k, dp)
    assert lay.num_buckets == k and lay.kind == kind
    for buf in lay.buffers:
        sizes = [lay.buckets[i].numel_unpadded for i in buf.buckets]
        slots = [s for s in lay.slots if s.buffer == buf.index]
        largest = max(s.size for s in slots)
        params = sum(s.size for s in slots)
        target = buf.numel_unpadded / k
        # every bucket is within one parameter of its share; the padding the layout adds
        # (dp pieces, 64-element starts, bucket ends) can move a cut point by as much
        slack = largest + (buf.numel - params)
        assert all(abs(n - target) <= slack for n in sizes), (sizes, target, slack)
        if largest <= params / k:
            assert len(sizes) == k, (sizes, largest, params / k)
        else:
            assert 1 <= len(sizes) <= k
    # the size the thresholds follow: the largest buffer's share
    big = max(b.numel_unpadded for b in lay.buffers)
    assert lay.bucket_size == math.ceil(big / k)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_bucket_is_one_bucket_per_buffer(kind):
    """num_buckets=1 lays out exactly as bucket_size=None (one bucket per buffer)."""
    one = layout_of("gpt", kind, 1, 8)
    none = BucketLayout.from_params(
        MODELS["gpt"](),
        DDPConfig(
            **KINDS[kind],
            **({"bucket_layout": "megatron"} if kind == "megatron" else {}),
            bucket_size=None,
        ),
        8,
    )
    assert one.slots == none.slots and one.buckets == none.buckets


def test_cut_points_on_a_hand_worked_case():
    """Ten 100-element params, k = 3: the cut points 333.3 and 666.7 are reached by the 4th
    and the 7th param (400, 700), so the buckets hold 4, 3 and 3 params."""
    params = [jax.ShapeDtypeStruct((100,), jnp.float32) for _ in range(10)]
    lay = BucketLayout.from_params(params, DDPConfig(num_buckets=3), 2)
    assert [b.numel_unpadded for b in lay.buckets] == [400, 300, 300]
    assert lay.bucket_size == 334
    # Megatron's own rule (bucket_size = params // k = 333, a bucket closes once it reaches
    # it) would cut 400, 400, 200.
    meg = BucketLayout.from_params(params, DDPConfig(bucket_size=1000 // 3), 2)
    assert [b.numel_unpadded for b in meg.buckets] == [400, 400, 200]


def test_own_bucket_params_and_no_overlap():
    tree = shapes_of(GPTISH)
    own = BucketLayout.from_params(
        tree, DDPConfig(num_buckets=2, own_bucket_param_patterns=("embed",)), 4
    )
    # layout order is norm, embed, block3 ... block0: the embedding closes the open bucket
    # (Megatron's rule) and takes one of its own; the blocks after it still make two
    assert [b.param_paths[0] for b in own.buckets][:2] == ["norm", "embed"]
    assert len(own.buckets[1].param_paths) == 1 and len(own.buckets) == 4
    off = BucketLayout.from_params(tree, DDPConfig(num_buckets=4, overlap_grad_reduce=False), 4)
    assert len(off.buckets) == 1 and off.num_buckets is None


@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        (0, ValueError, "an int >= 1"),
        (-2, ValueError, "an int >= 1"),
        (2.5, TypeError, "num_buckets=4"),
        (True, TypeError, "num_buckets=4"),
        ("4", TypeError, "num_buckets=4"),
    ],
)
def test_bad_num_buckets(value, exc, match):
    with pytest.raises(exc, match=r"DDPConfig\.num_buckets") as e:
        DDPConfig(num_buckets=value)
    assert match in str(e.value) and repr(value) in str(e.value)


@pytest.mark.parametrize("bucket_size", [1_000_000, None])
def test_num_buckets_with_an_explicit_bucket_size(bucket_size):
    with pytest.raises(ValueError, match=r"DDPConfig\.num_buckets") as e:
        DDPConfig(bucket_size=bucket_size, num_buckets=4)
    msg = str(e.value)
    assert f"bucket_size={bucket_size!r}" in msg and "drop bucket_size" in msg
    cfg = DDPConfig(bucket_size="auto", num_buckets=4)  # the default is fine
    assert cfg.resolve_bucket_size(8) is None
    assert DDPConfig.from_dict(cfg.to_dict()) == cfg


def test_combine_thresholds_follow_the_layout():
    cfg = DDPConfig(zero_stage=1, num_buckets=4, param_dtype="bfloat16")
    with pytest.raises(ValueError, match="bucket_numel"):
        combine_thresholds(cfg, dp_size=8)
    lay = BucketLayout.from_params(shapes_of(EQUAL), cfg, 8)
    got = combine_thresholds(cfg, dp_size=8, bucket_numel=lay.bucket_size)
    n = lay.bucket_size
    assert got == {
        "xla_gpu_all_reduce_combine_threshold_bytes": 2 * n - 1,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": n // 8 * 2 - 1,
        "xla_gpu_all_gather_combine_threshold_bytes": 2 * n - 1,
    }
    # No bucket is over that size by more than one parameter, and any two consecutive ones
    # together are over it, so XLA's combiner never merges two neighbours.
    sizes = [b.numel_unpadded for b in lay.buckets]
    assert all(a + b > n for a, b in itertools.pairwise(sizes))
    with pytest.raises(ValueError, match="bucket_numel=0"):
        combine_thresholds(cfg, dp_size=8, bucket_numel=0)


# ---------------------------------------------------------------- engine parity
STEPS = 3
SIZES = (6, 12, 12, 12, 12, 4)  # no parameter over a third of the model: 3 buckets


@pytest.fixture(scope="module")
def data():
    params = mlp_params(sizes=SIZES)
    return params, [make_batch(48, seed=s, sizes=SIZES) for s in range(STEPS)]


@pytest.mark.parametrize(("stage", "dp", "g"), [(0, 8, 1), (1, 8, 2), (2, 3, 2), (3, 8, 1)])
def test_engine_matches_the_reference(data, stage, dp, g):
    """An engine whose buckets num_buckets cut trains as the single-device reference does
    (fp32 everywhere: only the order of the sums differs)."""
    params, batches = data
    opt = optax.adamw(1e-2, weight_decay=0.1)
    ref, ref_norms = reference_train(mse_loss, opt, params, batches)
    cfg = DDPConfig(zero_stage=stage, num_buckets=3, num_microbatches=g)
    mesh = make_mesh(jax.devices()[:dp])
    engine = DataParallel(mse_loss, opt, cfg, mesh=mesh)
    state, norms = train_steps(engine, engine.init(params), batches)
    assert len(engine.layout.buckets) == 3
    assert max_rel_err(engine.params(state), ref) < 1e-6
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)


def test_engine_compiler_options_follow_the_layout(h100):
    """With compiler_options="jaxdp" on a GPU mesh the combine thresholds are set at init, from
    the bucket size the layout chose; the compiled step keeps the buckets apart."""
    from jaxdp.aot import abstract_batch, abstract_state, example_mlp, schedule_report
    from jaxdp.aot._compile import gradient_collectives

    loss_fn, params, batch = example_mlp(8, 256, batch=64)
    cfg = DDPConfig(zero_stage=1, num_buckets=4, param_dtype="bfloat16")
    own = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=h100, compiler_options="jaxdp")
    assert own.compiler_options is None  # not before the layout exists
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        state = abstract_state(own, params, batch)
        lowered = own.step.lower(state, abstract_batch(own, batch))
    n = own.layout.bucket_size
    assert len(own.layout.buckets) == 4
    assert own.compiler_options["xla_gpu_reduce_scatter_combine_threshold_bytes"] == n // 8 * 2 - 1
    grads = gradient_collectives(schedule_report(lowered.compile()), own)
    assert len(grads) >= 4, grads
