"""jaxdp-train and python -m jaxdp.launch as a user types them (subprocesses): no prefix
matching, a suggestion for a mistyped flag, errors against the flag typed, and --resume of a
finished run."""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "model": {"layers": 1, "width": 32, "heads": 2, "context": 16},
    "train": {
        "steps": 2,
        "global_batch": 16,
        "micro_batch": 2,
        "log_every": 1,
        "eval_every": 2,
        "eval_batches": 1,
        "checkpoint_every": 2,
        "sample_bytes": 0,
        "warmup": 1,
        "decay_steps": 10,
    },
}


def _run(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "cmd, typed, meant",
    [
        (["jaxdp.train", "--zero-stag", "2"], "--zero-stag 2", "--zero-stage"),
        (["jaxdp.train", "--stpes", "5"], "--stpes 5", "--steps"),
        (["jaxdp.train", "--out=x", "--resum"], "--resum", "--resume"),
        (
            ["jaxdp.launch", "--nproc", "2", "--hang-timout", "5"],
            "--hang-timout 5",
            "--hang-timeout",
        ),
    ],
)
def test_no_abbreviations_and_a_suggestion(cmd, typed, meant):
    r = _run(*cmd)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"unrecognized arguments: {typed}" in r.stderr
    assert f"{typed.split()[0]}: did you mean {meant}?" in r.stderr


def test_launcher_says_where_training_flags_go():
    r = _run("jaxdp.launch", "--nproc", "2", "--steps", "5")
    assert r.returncode == 2
    assert "unrecognized arguments: --steps 5 (jaxdp-train's arguments go after '--'" in r.stderr


def test_a_bad_zero_stage_is_reported_against_the_flag(tmp_path):
    r = _run("jaxdp.train", "--zero-stage", "4", "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert r.stderr.startswith("jaxdp-train: error: --zero-stage 4: DDPConfig.zero_stage: got 4")
    assert "--set" not in r.stderr and "Fix:" in r.stderr
    # a bad --set is still reported as the --set it was
    r = _run("jaxdp.train", "--set", "zero_stage=5", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "--set [ddp]: DDPConfig.zero_stage: got 5" in r.stderr


def test_resume_of_a_finished_run_has_nothing_to_do(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    out = str(tmp_path / "run")
    r = _run("jaxdp.train", "--config", str(cfg), "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = os.path.join(out, "metrics.jsonl")
    before = (os.path.getmtime(metrics), os.listdir(os.path.join(out, "checkpoints")))
    t0 = time.monotonic()
    r = _run("jaxdp.train", "--out", out, "--resume")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert "jaxdp-train: nothing to do: the run is at step 2 = --steps" in r.stdout
    assert "compiling" not in r.stdout + r.stderr and "jaxdp-train: GPT" not in r.stdout
    assert (os.path.getmtime(metrics), os.listdir(os.path.join(out, "checkpoints"))) == before
    with open(metrics) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    r = _run("jaxdp.train", "--out", out, "--resume", "--steps", "1")
    assert r.returncode == 0 and "the run is at step 2 past --steps 1" in r.stdout
    print(f"--resume with nothing to do: {took:.1f} s (python + imports)")
