"""DDPConfig: every field rejects a bad value with a message naming field, value and fix."""

import dataclasses
import re

import jax.numpy as jnp
import pytest

from jaxdp import DDPConfig, default_bucket_size

# (field, bad value, exception, fragment of the expected message)
BAD_VALUES = [
    ("zero_stage", 4, ValueError, "pick one of 0, 1, 2, 3"),
    ("zero_stage", -1, ValueError, "pick one of 0, 1, 2, 3"),
    ("zero_stage", "1", TypeError, "an int in {0, 1, 2, 3}"),
    ("zero_stage", True, TypeError, "an int in {0, 1, 2, 3}"),
    ("bucket_size", 0, ValueError, "a positive number of elements"),
    ("bucket_size", -5, ValueError, "a positive number of elements"),
    ("bucket_size", 1.5, TypeError, "a positive int (elements), None"),
    ("bucket_size", "big", TypeError, "a positive int (elements), None"),
    ("overlap_grad_reduce", 1, TypeError, "a bool"),
    ("average_in_collective", "yes", TypeError, "a bool"),
    ("grad_reduce_in_fp32", None, TypeError, "a bool"),
    ("reduce_scatter_with_fp32_accumulation", 0, TypeError, "a bool"),
    ("pad_buckets_for_high_nccl_busbw", "no", TypeError, "a bool"),
    ("check_for_nan_in_grad", 2, TypeError, "a bool"),
    ("clip_grad", -1.0, ValueError, "a finite, non-negative max norm"),
    ("clip_grad", float("inf"), ValueError, "a finite, non-negative max norm"),
    ("clip_grad", float("nan"), ValueError, "a finite, non-negative max norm"),
    ("clip_grad", "1.0", TypeError, "None (off) or a non-negative float"),
    ("grad_norm_skip_threshold", 0.0, ValueError, "a positive, finite float"),
    ("grad_norm_skip_threshold", float("inf"), ValueError, "a positive, finite float"),
    ("grad_norm_skip_threshold", "10", TypeError, "None (off) or a positive float"),
    ("check_for_large_grads", 1, TypeError, "a bool"),
    ("num_buckets", 0, ValueError, "an int >= 1"),
    ("num_buckets", 2.0, TypeError, "an int >= 1 (buckets per buffer)"),
    ("optimizer_cpu_offload", "yes", TypeError, "a bool"),
    ("optimizer_offload_fraction", 0.0, ValueError, "(0, 1]"),
    ("optimizer_offload_fraction", "1", TypeError, "a float in (0, 1]"),
    ("num_microbatches", 0, ValueError, "an int >= 1"),
    ("num_microbatches", 2.0, TypeError, "a positive int"),
    ("calculate_per_token_loss", "true", TypeError, "a bool"),
    ("deterministic_reduction", 1, TypeError, "a bool"),
    ("param_dtype", "int32", ValueError, "a floating dtype name"),
    ("param_dtype", "floaty", TypeError, "a floating dtype name"),
    ("main_grads_dtype", None, TypeError, "a floating dtype name"),
    ("main_grads_dtype", "int8", ValueError, "a floating dtype name"),
    ("data_axis", "", ValueError, "a non-empty mesh axis name"),
    ("data_axis", 3, TypeError, "the str name of a mesh axis"),
    ("own_bucket_param_patterns", "*embed*", TypeError, "wrap a single pattern in a tuple"),
    ("own_bucket_param_patterns", ("ok", 3), TypeError, "non-empty pattern strings only"),
    ("bucket_layout", "ring", ValueError, "one of ('interleaved', 'megatron')"),
    ("gradient_accumulation_fusion", "yes", TypeError, "a bool"),
    ("overlap_param_gather", 1, TypeError, "a bool"),
    ("expert_axis", 3, TypeError, "None or the non-empty str name"),
    ("expert_axis", "", ValueError, "None or the non-empty str name"),
    ("expert_axis", "data", ValueError, "a mesh axis other than data_axis='data'"),
    ("expert_param_patterns", "moe/*", TypeError, "wrap a single pattern in a tuple"),
    ("expert_param_patterns", ("ok", ""), TypeError, "non-empty pattern strings only"),
    ("scan_layers", "auto", TypeError, "a bool"),
    ("scan_param_patterns", "layers/", TypeError, "(regex, stacked axis) pairs"),
    ("scan_param_patterns", (("layers/", -1),), TypeError, "axis >= 0"),
    ("scan_param_patterns", (("(", 0),), ValueError, "valid regular expressions"),
    ("remat_policy", "minimal", ValueError, "one of ('gemm', 'dots', 'everything', 'nothing')"),
    ("remat_policy", None, TypeError, "one of ('gemm', 'dots', 'everything', 'nothing')"),
    ("model_state_sync", "sum", ValueError, "one of ('mean', 'broadcast')"),
    ("model_state_sync", 1, TypeError, "one of ('mean', 'broadcast')"),
    ("num_distributed_optimizer_instances", 0, ValueError, "an int >= 1"),
    ("num_distributed_optimizer_instances", 2.0, TypeError, "an int >= 1"),
    ("num_distributed_optimizer_instances", True, TypeError, "an int >= 1"),
    ("outer_dp_sharding_strategy", "full", ValueError, "one of ('no_shard', 'optim')"),
    ("outer_dp_sharding_strategy", None, TypeError, "one of ('no_shard', 'optim')"),
    ("data_axis", ("a", "a"), ValueError, "two distinct names"),
    ("data_axis", ("a",), TypeError, "two distinct names"),
    ("exp_avg_dtype", "float16", ValueError, "float16 is not offered"),
    ("exp_avg_dtype", None, TypeError, "one of ('float32', 'bfloat16')"),
    ("exp_avg_sq_dtype", "float64", ValueError, "one of ('float32', 'bfloat16')"),
    ("exp_avg_sq_dtype", "bfloat", TypeError, "one of ('float32', 'bfloat16')"),
]


@pytest.mark.parametrize(("field", "value", "exc", "fragment"), BAD_VALUES)
def test_bad_value_names_field_value_and_fix(field, value, exc, fragment):
    with pytest.raises(exc) as info:
        DDPConfig(**{field: value})
    msg = str(info.value)
    assert msg.startswith(f"DDPConfig.{field}: got {value!r}"), msg
    assert fragment in msg
    assert "Fix:" in msg


def test_every_field_has_a_bad_value_test():
    import dataclasses

    tested = {f for f, *_ in BAD_VALUES}
    assert tested == {f.name for f in dataclasses.fields(DDPConfig)}


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        (
            {"reduce_scatter_with_fp32_accumulation": True},
            "reduce_scatter_with_fp32_accumulation",
            "zero_stage >= 1",
        ),
        (
            {
                "reduce_scatter_with_fp32_accumulation": True,
                "zero_stage": 1,
                "average_in_collective": True,
            },
            "reduce_scatter_with_fp32_accumulation",
            "AVG",
        ),
        (
            {
                "reduce_scatter_with_fp32_accumulation": True,
                "zero_stage": 2,
                "grad_reduce_in_fp32": True,
            },
            "reduce_scatter_with_fp32_accumulation",
            "already reduces in fp32",
        ),
        (
            {"calculate_per_token_loss": True, "average_in_collective": True},
            "calculate_per_token_loss",
            "global token count",
        ),
        (
            {"pad_buckets_for_high_nccl_busbw": True},
            "pad_buckets_for_high_nccl_busbw",
            "zero_stage >= 1",
        ),
        (
            {"overlap_param_gather": True},
            "overlap_param_gather",
            "a distributed optimizer (zero_stage >= 1)",
        ),
        (
            {"gradient_accumulation_fusion": True, "zero_stage": 3},
            "gradient_accumulation_fusion",
            "zero_stage <= 2",
        ),
        ({"remat_policy": "dots", "zero_stage": 2}, "remat_policy", "zero_stage=3"),
        ({"remat_policy": "nothing"}, "remat_policy", "jax.checkpoint yourself"),
    ],
)
def test_invalid_combinations(kwargs, field, fragment):
    with pytest.raises(ValueError, match=re.escape(f"DDPConfig.{field}")) as info:
        DDPConfig(**kwargs)
    assert fragment in str(info.value)
    assert "Fix:" in str(info.value)


def test_valid_megatron_variant_and_normalisation():
    cfg = DDPConfig(
        zero_stage=1,
        reduce_scatter_with_fp32_accumulation=True,
        param_dtype=jnp.bfloat16,
        clip_grad=0,
        own_bucket_param_patterns=["*embed*"],
    )
    assert cfg.param_dtype == "bfloat16"
    assert cfg.clip_grad is None
    assert cfg.own_bucket_param_patterns == ("*embed*",)
    assert cfg.use_distributed_optimizer
    assert hash(cfg) == hash(
        DDPConfig(**cfg.to_dict() | {"own_bucket_param_patterns": ("*embed*",)})
    )


def test_overlap_param_gather_message_and_stage3():
    with pytest.raises(ValueError) as info:
        DDPConfig(overlap_param_gather=True)
    msg = str(info.value)
    assert msg.startswith("DDPConfig.overlap_param_gather: got True")
    assert "zero_stage=1" in msg and "Fix:" in msg
    assert not DDPConfig(zero_stage=2).shards_params
    assert DDPConfig(zero_stage=1, overlap_param_gather=True).shards_params
    assert DDPConfig(zero_stage=3).shards_params  # implied at stage 3
    assert DDPConfig(zero_stage=3, overlap_param_gather=True).to_dict()["overlap_param_gather"]


def test_bucket_size_resolution():
    assert default_bucket_size(1) == 40_000_000
    assert default_bucket_size(64) == 64_000_000
    assert DDPConfig().resolve_bucket_size(8) == 40_000_000
    assert DDPConfig().resolve_bucket_size(128) == 128_000_000
    assert DDPConfig(bucket_size=None).resolve_bucket_size(8) is None
    assert DDPConfig(bucket_size=123).resolve_bucket_size(8) == 123
    # As in Megatron, no overlap means a single bucket per buffer.
    assert DDPConfig(bucket_size=123, overlap_grad_reduce=False).resolve_bucket_size(8) is None


def test_owns_bucket_patterns():
    cfg = DDPConfig(own_bucket_param_patterns=("embed/*", "*/tied"))
    assert cfg.owns_bucket("embed/embedding")
    assert cfg.owns_bucket("decoder/tied")
    assert not cfg.owns_bucket("dense/kernel")


def test_yaml_round_trip(tmp_path):
    cfg = DDPConfig(
        zero_stage=2,
        bucket_size=1000,
        grad_reduce_in_fp32=True,
        clip_grad=1.0,
        num_microbatches=4,
        param_dtype="bfloat16",
        own_bucket_param_patterns=("*embedding*",),
        overlap_param_gather=True,
        scan_param_patterns=(("^blocks/", 1),),
    )
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    assert DDPConfig.from_yaml(path) == cfg
    assert DDPConfig.from_yaml(path).to_yaml() == cfg.to_yaml()


@pytest.mark.parametrize("policy", ["gemm", "dots", "everything", "nothing"])
def test_remat_policy_from_yaml(tmp_path, policy):
    path = tmp_path / "c.yaml"
    path.write_text(f"zero_stage: 3\nremat_policy: {policy}\n")
    assert DDPConfig.from_yaml(path) == DDPConfig(zero_stage=3, remat_policy=policy)
    assert DDPConfig.from_yaml(path).remat_policy == policy


def test_yaml_unknown_key_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("zero_stage: 1\nbucket_sise: 10\nfoo: 1\n")
    with pytest.raises(ValueError) as info:
        DDPConfig.from_yaml(path)
    msg = str(info.value)
    assert "'bucket_sise' (did you mean 'bucket_size'?)" in msg
    assert "'foo'" in msg
    assert str(path) in msg


def test_yaml_bad_value_and_bad_document(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("zero_stage: 7\n")
    with pytest.raises(ValueError, match=r"DDPConfig\.zero_stage: got 7"):
        DDPConfig.from_yaml(path)
    path.write_text("- 1\n- 2\n")
    with pytest.raises(TypeError, match="expected a mapping"):
        DDPConfig.from_yaml(path)
    path.write_text("")
    assert DDPConfig.from_yaml(path) == DDPConfig()


def test_shipped_configs_load():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files, "configs/ should ship example YAML files"
    for f in files:
        if f.name.startswith("gpt_"):  # jaxdp-train run configs: model/train/ddp sections
            from jaxdp.train._options import load_run_config

            load_run_config(str(f))
        else:
            DDPConfig.from_yaml(f)


def test_unknown_keyword_is_named_with_a_suggestion():
    names = [f.name for f in dataclasses.fields(DDPConfig)]
    fields = re.escape(f"expected only the fields {names}")
    want = r"DDPConfig: unknown keyword argument\(s\) 'zero_stag' \(did you mean 'zero_stage'\?\)"
    with pytest.raises(TypeError, match=f"{want}; {fields}. Fix: rename or remove them."):
        DDPConfig(zero_stag=1)
    with pytest.raises(TypeError, match=f"{want}; {fields}"):  # replace goes through __init__
        DDPConfig().replace(zero_stag=1)
    with pytest.raises(TypeError, match=r"'foo', 'bucket_sise' \(did you mean 'bucket_size'\?\)"):
        DDPConfig(foo=1, bucket_sise=3)
    with pytest.raises(TypeError, match="multiple values for argument 'zero_stage'"):
        DDPConfig(0, zero_stage=1)  # Python's own errors are untouched


def test_constructor_keeps_dataclass_behaviour():
    import copy
    import dataclasses
    import inspect
    import pickle

    cfg = DDPConfig(1, 1000, clip_grad=1.0)  # positional fields still work
    assert (cfg.zero_stage, cfg.bucket_size, cfg.clip_grad) == (1, 1000, 1.0)
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg)
    assert hash(cfg) == hash(DDPConfig(zero_stage=1, bucket_size=1000, clip_grad=1.0))
    assert cfg.replace(zero_stage=2) == dataclasses.replace(cfg, zero_stage=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.zero_stage = 0
    params = list(inspect.signature(DDPConfig).parameters)
    assert params == [f.name for f in dataclasses.fields(DDPConfig)]
    with pytest.raises(ValueError, match="pick one of 0, 1, 2, 3"):  # still validated
        DDPConfig(zero_stage=7)
