"""python -m jaxdp.launch: 2 processes x 4 devices log the same losses as 1 process x 8."""

import json
import os
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "model": {"layers": 1, "width": 32, "heads": 2, "context": 16},
    "train": {
        "steps": 3,
        "global_batch": 16,
        "micro_batch": 1,
        "log_every": 1,
        "eval_every": 3,
        "eval_batches": 1,
        "checkpoint_every": 3,
        "sample_bytes": 0,
    },
}


def _env(devices=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT
    env["JAX_PLATFORMS"] = "cpu"
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_two_processes_match_one_bit_for_bit(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    train = ["--config", str(cfg)]
    r = subprocess.run(
        [sys.executable, "-m", "jaxdp.train", *train, "--out", one],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(
        [sys.executable, "-m", "jaxdp.launch", "--nproc", "2", "--", *train, "--out", two],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "8 x cpu devices in 2 process(es)" in r.stdout.replace("\n", " ")
    a, b = _losses(one), _losses(two)
    assert len(a) == len(b) == 3
    # Bit-identical: with deterministic_reduction (the main job's default) the summation order
    # does not depend on the process split.
    assert a == b


def test_launcher_rejects_its_own_flags():
    r = subprocess.run(
        [sys.executable, "-m", "jaxdp.launch", "--nproc", "2", "--", "--process-id", "1"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--process-id is set by the launcher" in r.stderr
