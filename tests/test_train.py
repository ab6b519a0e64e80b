"""jaxdp-train (in-process, tiny configs): outputs, exact resume and every bad-input path."""

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from jaxdp.train import main
from jaxdp.train._options import load_run_config
from jaxdp.train._report import MetricsLog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "model": {"layers": 1, "width": 32, "heads": 2, "context": 16},
    "train": {
        "steps": 4,
        "global_batch": 16,
        "micro_batch": 1,
        "log_every": 1,
        "eval_every": 2,
        "eval_batches": 1,
        "checkpoint_every": 2,
        "sample_bytes": 8,
        "warmup": 2,
        "decay_steps": 10,
    },
}


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_default_config_file_matches_the_defaults():
    assert load_run_config(os.path.join(ROOT, "configs", "gpt_tiny.yaml")) == load_run_config(None)


def test_outputs_and_exact_resume(tmp_path, tiny, capsys):
    straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["--config", tiny, "--out", straight]) == 0
    recs = _losses(straight)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert set(r) >= {"step", "loss", "grad_norm", "tokens_per_s"}
    assert [r["step"] for r in recs if "val_loss" in r] == [2, 4]
    for f in ("loss.png", "config.yaml", "summary.json", "checkpoints"):
        assert os.path.exists(os.path.join(straight, f)), f
    with open(os.path.join(straight, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    assert saved["model"] == {
        **TINY["model"],
        "vocab": 256,
        "dropout": 0.0,
        "scan": False,
        "attention": "auto",
    }
    assert saved["ddp"]["num_microbatches"] == 1  # resolved config, not the input
    with open(os.path.join(straight, "summary.json")) as f:
        # jaxdp's XLA options are GPU options: none on XLA:CPU
        assert json.load(f)["xla_options"] == {}
    out = capsys.readouterr().out
    assert "summary" in out and "MFU (dense bf16 peak)" in out  # "-" on CPUs (no peak)
    assert "buckets: " in out and "NVLink model: " in out  # the size and the model's time

    # Half the steps, then --resume to the end: the same losses, bit for bit.
    assert main(["--config", tiny, "--out", resumed, "--steps", "2"]) == 0
    assert main(["--out", resumed, "--resume", "--steps", "4"]) == 0
    got = _losses(resumed)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["loss"] for r in got] == [r["loss"] for r in recs]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in recs]
    assert [r.get("val_loss") for r in got] == [r.get("val_loss") for r in recs]

    # SIGINT (deterministically: right after step 2 is logged) stops the run at the next step
    # boundary with a checkpoint of that step; --resume continues it bit for bit.
    stopped = str(tmp_path / "c")
    append = MetricsLog.append

    def append_then_signal(self, record):
        append(self, record)
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    handler = signal.getsignal(signal.SIGINT)
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(MetricsLog, "append", append_then_signal)
        assert main(["--config", tiny, "--out", stopped]) == 0
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    out = capsys.readouterr().out
    assert "jaxdp-train: stopped by SIGINT at step 3; checkpoint saved; continue with" in out
    assert "summary" not in out
    assert [r["step"] for r in _losses(stopped)] == [1, 2, 3]
    assert sorted(os.listdir(os.path.join(stopped, "checkpoints"))) == ["2", "3"]
    assert main(["--out", stopped, "--resume"]) == 0
    assert [r["loss"] for r in _losses(stopped)] == [r["loss"] for r in recs]


def test_gpu_config_is_a_300m_gpt():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdp.models import GPT
    from jaxdp.train._mfu import train_flops_per_token

    cfg = load_run_config(os.path.join(ROOT, "configs", "gpt_300m_gpu.yaml"))
    # Blocks unrolled: the scanned step was 1.40x slower on an H200 (BENCHMARKS.md section 13).
    assert not cfg.model.scan and cfg.ddp.param_dtype == "bfloat16"
    tokens = jax.ShapeDtypeStruct((1, cfg.model.context), jnp.int32)
    params = jax.eval_shape(GPT(cfg.model).init, jax.random.key(0), tokens)["params"]
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert 300e6 < n < 310e6, n
    assert params["block_23"]["fc"]["kernel"].shape == (1024, 4096)
    assert train_flops_per_token(cfg.model, n) > 6 * n
    assert cfg.model.attention == "auto"  # cuDNN's flash attention on the GPU it is for


def test_attention_choice():
    """``GPTConfig.attention``: jax's own default (``implementation=None``) is XLA's attention,
    which on an H200 made the 303M GPT 2.2x slower and twice the memory; "auto" picks
    cuDNN on GPUs for the dtypes and head sizes its flash kernel takes, XLA's elsewhere."""
    import jax.numpy as jnp

    from jaxdp.models import GPTConfig, attention_implementation

    with pytest.raises(ValueError, match=r"attention='flash'.*'auto'"):
        GPTConfig(attention="flash")
    with pytest.raises(ValueError, match=r"choice='flash'.*'auto'"):
        attention_implementation("flash", jnp.bfloat16, 64)
    assert attention_implementation("auto", jnp.bfloat16, 64) == "xla"  # this CPU
    assert attention_implementation("xla", jnp.bfloat16, 64) == "xla"
    assert attention_implementation("cudnn", jnp.float32, 64) == "cudnn"  # forced: jax decides
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jax.default_backend", lambda: "gpu")
        assert attention_implementation("auto", jnp.bfloat16, 64) == "cudnn"
        assert attention_implementation("auto", jnp.float16, 128) == "cudnn"
        assert attention_implementation("auto", jnp.float32, 64) == "xla"  # no fp32 flash
        assert attention_implementation("auto", jnp.bfloat16, 60) == "xla"  # not a multiple of 8
        assert attention_implementation("auto", jnp.bfloat16, 256) == "xla"


def test_dropout_key_stream_resumes_exactly(tmp_path):
    """With dropout the engine draws a key per step from one run key kept in the checkpoint:
    half the steps and --resume give the straight run's losses bit for bit."""
    # the blocks in one nn.scan (GPTConfig.scan), dropout keys split per layer
    cfg = {**TINY, "model": {**TINY["model"], "layers": 2, "scan": True, "dropout": 0.2}}
    path = tmp_path / "drop.yaml"
    path.write_text(yaml.safe_dump(cfg))
    straight, resumed, plain = (str(tmp_path / d) for d in ("a", "b", "c"))
    assert main(["--config", str(path), "--out", straight]) == 0
    assert main(["--config", str(path), "--out", resumed, "--steps", "2"]) == 0
    assert main(["--out", resumed, "--resume", "--steps", "4"]) == 0
    want = [r["loss"] for r in _losses(straight)]
    assert [r["loss"] for r in _losses(resumed)] == want
    path.write_text(yaml.safe_dump({**cfg, "model": {**cfg["model"], "dropout": 0.0}}))
    assert main(["--config", str(path), "--out", plain, "--steps", "2"]) == 0
    assert [r["loss"] for r in _losses(plain)][1] != want[1]  # dropout is on


def test_signal_before_the_first_step(tmp_path, tiny, capsys, monkeypatch):
    from jaxdp.train import _loop

    def load_then_signal(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return corpus(*a, **k)

    corpus = _loop.load_corpus
    monkeypatch.setattr(_loop, "load_corpus", load_then_signal)
    out = str(tmp_path / "run")
    assert main(["--config", tiny, "--out", out]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "stopped by SIGTERM before the first step; nothing saved" in err
    assert not os.path.exists(os.path.join(out, "checkpoints"))


def _error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdp-train: error: ") and "Traceback" not in err
    return err


def test_bad_config_inputs(tmp_path, tiny, capsys):
    out = str(tmp_path / "out")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {stpes: 3}\n")
    err = _error(capsys, ["--config", str(bad), "--out", out])
    assert "bad.yaml" in err and "'stpes'" in err and "'steps'" in err
    bad.write_text("train: {steps: three}\n")
    err = _error(capsys, ["--config", str(bad), "--out", out])
    assert "steps='three'" in err and "int" in err
    bad.write_text("ddp: {zero_stag: 1}\n")
    assert "zero_stag" in _error(capsys, ["--config", str(bad), "--out", out])
    err = _error(capsys, ["--config", tiny, "--out", out, "--set", "zero_stage=five"])
    assert "zero_stage" in err
    assert "no_such_field" in _error(capsys, ["--out", out, "--set", "no_such_field=1"])
    assert "key=value" in _error(capsys, ["--out", out, "--set", "zero_stage"])
    assert "only 8 cpu devices" in _error(
        capsys, ["--config", tiny, "--out", out, "--devices", "99"]
    )
    assert "no such file" in _error(capsys, ["--config", str(tmp_path / "x.yaml"), "--out", out])
    err = _error(capsys, ["--config", tiny, "--out", out, "--global-batch", "20"])
    assert "global_batch=20" in err and "micro_batch x dp = 1 x 8" in err
    assert not os.path.exists(out)  # nothing was written


def test_bad_data_inputs(tmp_path, tiny, capsys):
    out = str(tmp_path / "out")
    err = _error(capsys, ["--config", tiny, "--out", out, "--data", str(tmp_path / "missing")])
    assert "missing" in err and "no such file" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no text files" in _error(capsys, ["--config", tiny, "--out", out, "--data", str(empty)])
    (empty / "a.txt").write_text("tiny")
    err = _error(capsys, ["--config", tiny, "--out", out, "--data", str(empty)])
    assert "context + 1 = 17" in err
    assert not os.path.exists(out)


def test_existing_run_other_model_and_resume_errors(tmp_path, tiny, capsys):
    out = str(tmp_path / "run")
    assert "nothing to resume" in _error(capsys, ["--out", out, "--resume"])
    assert main(["--config", tiny, "--out", out, "--steps", "2"]) == 0
    capsys.readouterr()
    before = {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)}
    err = _error(capsys, ["--config", tiny, "--out", out])
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    err = _error(capsys, ["--out", out, "--resume", "--set", "model.width=64", "--steps", "3"])
    assert "['block_0']['attn']['out']['bias'] has shape (32,)" in err and "(64,)" in err
    assert "contradict" in _error(capsys, ["--out", out, "--resume", "--overwrite"])
    after = {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)}
    assert before == after  # nothing overwritten
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert main(["--config", tiny, "--out", out, "--overwrite", "--steps", "1"]) == 0
    assert [r["step"] for r in _losses(out)] == [1]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_cli_error_is_one_line_in_a_fresh_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [sys.executable, "-m", "jaxdp.train", "--out", str(tmp_path), "--set", "bogus=1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "jaxdp-train: error: " in r.stderr and "'bogus'" in r.stderr


def test_spike_checks_are_counted_in_the_log_and_summary(tmp_path, tiny, capsys):
    """--set grad_norm_skip_threshold / check_for_large_grads reach the engine; a threshold no
    step passes skips every step, which the log, the warning and the summary count."""
    out = str(tmp_path / "s")
    sets = ["--set", "grad_norm_skip_threshold=1e-9", "--set", "check_for_large_grads=true"]
    assert main(["--config", tiny, "--out", out, "--steps", "3", *sets]) == 0
    recs = _losses(out)
    assert [r["skipped_steps"] for r in recs] == [1, 2, 3]
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["skipped_steps"] == 3
    printed = capsys.readouterr().out
    assert "skipped 1 step(s) up to step 1" in printed
    assert "skipped steps (abnormal gradient)" in printed


def test_bf16_moments_reach_the_engine_and_summary(tmp_path, tiny, capsys):
    """--set exp_avg_dtype / exp_avg_sq_dtype (Megatron's short names too) store the moments
    in bfloat16; the summary reports the optimizer state and its moments' dtypes."""
    out = str(tmp_path / "m")
    sets = ["--set", "exp_avg_dtype=bf16", "--set", "ddp.exp_avg_sq_dtype=bfloat16"]
    assert main(["--config", tiny, "--out", out, "--steps", "2", *sets]) == 0
    with open(os.path.join(out, "config.yaml")) as f:
        ddp = yaml.safe_load(f)["ddp"]
    assert (ddp["exp_avg_dtype"], ddp["exp_avg_sq_dtype"]) == ("bfloat16", "bfloat16")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["moment_dtypes"] == ["bfloat16", "bfloat16"]
    assert 0 < summary["opt_state_bytes_per_device"] < summary["state_bytes_per_device"]
    printed = " ".join(capsys.readouterr().out.split())
    assert "of which optimizer state" in printed and "Adam moments: bfloat16" in printed
