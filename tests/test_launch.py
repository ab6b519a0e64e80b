"""python -m jaxdp.launch and multi-process jaxdp-train: runs that end (sample and summary
included, within seconds of the last step), SIGTERM -> a checkpoint at one agreed step -> an
exact --resume, dead processes, a stopped process (the hang watchdog), an unreachable
coordinator, and the environments of SLURM, jax, MaxText and SkyPilot.

2 processes x 4 devices log bit-identical losses to 1 process x 8 (deterministic_reduction),
with dropout on.
Every subprocess has a timeout and every test kills what it started. The runs share a
persistent compilation cache (process 0 and one-process runs hit it after the first run).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from jaxdp.launch import stop_processes
from jaxdp.launch._progress import read_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 200  # a SIGTERM after the first steps lands mid-run (checks are ~0.25 s apart)
TINY = {
    # dropout on: the per-step keys are the same at any process count and continue on --resume
    "model": {"layers": 1, "width": 32, "heads": 2, "context": 16, "dropout": 0.1},
    "train": {
        "steps": STEPS,
        "global_batch": 16,
        "micro_batch": 2,
        "log_every": 1,
        "eval_every": 100,
        "eval_batches": 1,
        "checkpoint_every": 100,  # the stop's checkpoint is the only one before the end
        "sample_bytes": 8,
        "warmup": 2,
        "decay_steps": 10,
    },
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax-cache"))


def _env(cache=None, devices=None, **extra):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("SLURM")}
    env["PYTHONPATH"] = ROOT
    env["JAX_PLATFORMS"] = "cpu"
    if cache:
        env["JAX_COMPILATION_CACHE_DIR"] = cache
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env.update(extra)
    return env


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return [r["step"] for r in recs], [r["loss"] for r in recs]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid):
    """A live (not zombie) jaxdp.train process with this pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return state != "Z" and b"jaxdp.train" in cmd


def _child_pids(err_path):
    """The PIDs the launcher printed ("process I pid P, ...")."""
    with open(err_path) as f:
        for line in f:
            if line.startswith("jaxdp.launch: process 0 pid"):
                words = line.replace(",", " ").split()
                return [int(words[i + 1]) for i, w in enumerate(words) if w == "pid"]
    return []


class Run:
    """A background process with its output in files; killed (with its children) on exit."""

    def __init__(self, tmp_path, name, cmd, env):
        self.out_path, self.err_path = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        self._files = [open(self.out_path, "w"), open(self.err_path, "w")]  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._files[0], stderr=self._files[1])
        self.pids = []

    def output(self):
        return self.out_path.read_text() + self.err_path.read_text()

    def wait_for_steps(self, out, n, timeout=300):
        """Until OUT/metrics.jsonl has n lines (the run must still be going)."""
        path = os.path.join(out, "metrics.jsonl")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ended early:\n{self.output()[-3000:]}"
            if os.path.exists(path):
                with open(path) as f:
                    if sum(1 for _ in f) >= n:
                        self.pids = _child_pids(self.err_path)
                        return
            time.sleep(0.05)
        raise AssertionError(f"no {n} steps within {timeout} s:\n{self.output()[-3000:]}")

    def wait(self, timeout):
        t0 = time.monotonic()
        rc = self.proc.wait(timeout=timeout)
        for f in self._files:
            f.flush()
        self.pids = self.pids or _child_pids(self.err_path)
        return rc, time.monotonic() - t0

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids or _child_pids(self.err_path):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for f in self._files:
            f.close()


def _run(cmd, env, timeout):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, config, cache):
    """One process x 8 devices, STEPS steps unbroken: (steps, losses)."""
    out = str(tmp_path_factory.mktemp("ref") / "one")
    r = _run(
        [sys.executable, "-m", "jaxdp.train", "--config", config, "--out", out],
        _env(cache),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    steps, losses = _losses(out)
    assert steps == list(range(1, STEPS + 1))
    return losses


def test_sigterm_stops_two_processes_at_one_step_and_resume_matches_one_process(
    tmp_path, config, cache, reference
):
    two = str(tmp_path / "two")
    launch = [sys.executable, "-m", "jaxdp.launch", "--nproc", "2", "--grace", "60", "--"]
    run = Run(tmp_path, "stop", [*launch, "--config", config, "--out", two], _env(cache))
    try:
        run.wait_for_steps(two, 2)
        run.proc.send_signal(signal.SIGTERM)
        rc, _ = run.wait(timeout=120)
        text = run.output()
        assert rc == 0, text[-3000:]
        assert len(run.pids) == 2 and not any(_alive(p) for p in run.pids)
    finally:
        run.close()
    line = next(x for x in text.splitlines() if "stopped by SIGTERM at step" in x)
    saved = int(line.split("at step ")[1].split(";")[0])
    assert "checkpoint saved; continue with --resume" in line
    assert 2 <= saved < STEPS, line
    assert os.listdir(os.path.join(two, "checkpoints")) == [str(saved)]
    # Process 1 stopped at the same step (its own line, in its log).
    with open(os.path.join(two, "logs", "process_1.log")) as f:
        assert line.split(" (--out")[0] in f.read()

    # The launcher's run ends (sample and summary on process 0, every process joining the
    # collectives they need) and matches one process bit for bit, across the stop.
    r = _run([*launch, "--out", two, "--resume", "--steps", str(STEPS)], _env(cache), timeout=300)
    ended = time.time()
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]  # 0: every process exited 0
    # the processes end soon after the last step (sample, summary, jax.distributed.shutdown)
    last_step = os.path.getmtime(os.path.join(two, "metrics.jsonl"))
    assert ended - last_step < 10, f"{ended - last_step:.1f} s from the last step to the end"
    print(f"launcher ended {ended - last_step:.1f} s after the last step was logged")
    assert f"resumed at step {saved}" in r.stdout.replace("\n", " ")
    assert "8 x cpu devices in 2 process(es)" in r.stdout.replace("\n", " ")
    assert "jaxdp-train summary" in r.stdout and "sample (after 'def ')" in r.stdout
    steps, losses = _losses(two)
    assert steps == list(range(1, STEPS + 1))
    assert losses == reference  # bit for bit: before the stop, and after the resume


def _convention(name, i, port):
    """Process i of 2 on this host, as each launch convention describes it."""
    return {
        "SLURM": {
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(i),
            "SLURM_LOCALID": str(i),
            "SLURM_STEP_NODELIST": "127.0.0.1",
            "JAX_COORDINATOR_PORT": str(port),
        },
        "jax": {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(i),
        },
        "MaxText": {
            "JAX_COORDINATOR_IP": "127.0.0.1",
            "JAX_COORDINATOR_PORT": str(port),
            "NNODES": "2",
            "NODE_RANK": str(i),
        },
        "SkyPilot": {
            "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n",
            "SKYPILOT_NODE_RANK": str(i),
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            "JAX_COORDINATOR_PORT": str(port),
        },
    }[name]


@pytest.mark.parametrize("convention", ["SLURM", "jax", "MaxText", "SkyPilot"])
def test_a_launch_convention_starts_two_processes(tmp_path, config, cache, reference, convention):
    """jaxdp-train started twice by a cluster's variables only (no jaxdp.launch, no flags)
    logs the losses of one process on 8 devices, bit for bit."""
    out, port, n = str(tmp_path / "conv"), _free_port(), 6
    runs = []
    try:
        for i in range(2):
            cmd = [sys.executable, "-m", "jaxdp.train", "--config", config, "--out", out]
            cmd += ["--steps", str(n)]
            env = _env(cache, devices=4, **_convention(convention, i, port))
            runs.append(Run(tmp_path, f"{convention}{i}", cmd, env))
        codes = [r.wait(timeout=300)[0] for r in runs]
        assert codes == [0, 0], runs[0].output()[-2000:] + runs[1].output()[-2000:]
    finally:
        for r in runs:
            r.close()
    assert "8 x cpu devices in 2 process(es)" in runs[0].output().replace("\n", " ")
    steps, losses = _losses(out)
    assert steps == list(range(1, n + 1)) and losses == reference[:n]


def test_dead_coordinator_ends_the_run(tmp_path, config, cache):
    """kill -9 of process 0 (the coordinator): process 1 exits on its own, non-zero, well
    before the launcher's --grace, and the launcher names process 0 and exits non-zero."""
    out = str(tmp_path / "dead")
    cmd = [sys.executable, "-m", "jaxdp.launch", "--nproc", "2", "--grace", "60", "--"]
    cmd += ["--config", config, "--out", out, "--steps", "100000", "--heartbeat-timeout", "10"]
    run = Run(tmp_path, "dead", cmd, _env(cache))
    try:
        run.wait_for_steps(out, 1)
        assert len(run.pids) == 2
        os.kill(run.pids[0], signal.SIGKILL)
        rc, took = run.wait(timeout=120)
        text = run.output()
        assert rc == 128 + signal.SIGKILL, text[-3000:]
        assert took < 40, text[-3000:]  # not the launcher's 60 s grace: process 1 ended itself
        assert f"process 0 (pid {run.pids[0]}) killed by SIGKILL" in text
        assert "jaxdp.launch: killed" not in text
        assert not any(_alive(p) for p in run.pids)
    finally:
        run.close()


def test_hang_watchdog_ends_a_run_with_a_stopped_process(tmp_path, config, cache):
    """Process 1 frozen by SIGSTOP at step 10: within --hang-timeout + 60 s the launcher names
    it and its step, every process has written its Python stacks, none is left, status 124."""
    out = str(tmp_path / "hang")
    cmd = [sys.executable, "-m", "jaxdp.launch", "--nproc", "2", "--hang-timeout", "60", "--"]
    cmd += ["--config", config, "--out", out, "--steps", "100000"]
    run = Run(tmp_path, "hang", cmd, _env(cache))
    progress = os.path.join(out, "logs", "progress_1")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert run.proc.poll() is None, run.output()[-3000:]
            r = read_report(progress)
            if r is not None and r.step >= 10:
                break
            time.sleep(0.005)
        run.pids = _child_pids(run.err_path)
        assert len(run.pids) == 2
        os.kill(run.pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        time.sleep(0.5)
        frozen = read_report(progress)  # where it stopped (nothing writes it any more)
        rc, _ = run.wait(timeout=180)
        took = time.monotonic() - t0
        text = run.output()
        print(f"SIGSTOP at {frozen}: the launcher exited {took:.1f} s later (rc {rc})")
        assert rc == 124, text[-3000:]
        assert took < 120, text[-3000:]
        assert f"process 1 (pid {run.pids[1]}) made no progress since step {frozen.step}" in text
        assert frozen.step in (10, 11) and "It is stopped (SIGSTOP" in text
        assert not any(_alive(p) for p in run.pids)
        with open(os.path.join(out, "logs", "process_1.log")) as f:
            assert "most recent call first" in f.read()  # the stopped one's stacks too
        assert "most recent call first" in run.out_path.read_text() + text  # process 0's
    finally:
        run.close()


def test_without_a_launcher_the_peers_of_a_stopped_process_end_themselves(tmp_path, config, cache):
    """Two processes started by jax's variables (no jaxdp.launch), process 1 stopped at step
    10: process 0's watchdog thread names process 1 as behind (from the reports both published
    in jax's coordination service), dumps its own stacks and exits 124. The stopped process
    cannot end itself (docs/launching.md: the cluster launcher removes it)."""
    out, port, timeout = str(tmp_path / "nolauncher"), _free_port(), 30
    runs = []
    try:
        for i in range(2):
            cmd = [sys.executable, "-m", "jaxdp.train", "--config", config, "--out", out]
            cmd += ["--steps", "100000", "--hang-timeout", str(timeout)]
            env = _env(cache, devices=4, **_convention("jax", i, port))
            runs.append(Run(tmp_path, f"nolauncher{i}", cmd, env))
        runs[0].wait_for_steps(out, 10)
        os.kill(runs[1].proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        rc, _ = runs[0].wait(timeout=timeout + 120)
        took = time.monotonic() - t0
        text = runs[0].output()
        print(f"process 0 ended itself {took:.1f} s after process 1 was stopped (rc {rc})")
        assert rc == 124, text[-3000:]
        assert took < timeout + 60, text[-3000:]
        assert "jaxdp-train: hang: process 0 of 2 made no progress since step" in text
        assert "Behind: process 1 (since step" in text
        assert "most recent call first" in text
        assert runs[1].proc.poll() is None  # still stopped: the limit of an in-process watchdog
    finally:
        for r in runs:
            r.close()


def test_a_killed_launcher_takes_its_processes_along(tmp_path, config):
    out = str(tmp_path / "orphans")
    cmd = [sys.executable, "-m", "jaxdp.launch", "--nproc", "2", "--"]
    cmd += ["--config", config, "--out", out, "--init-timeout", "60"]
    run = Run(tmp_path, "orphans", cmd, _env())
    try:
        deadline = time.monotonic() + 60
        while not run.pids and time.monotonic() < deadline:
            time.sleep(0.05)
            run.pids = _child_pids(run.err_path)
        assert len(run.pids) == 2, run.output()
        run.proc.kill()  # SIGKILL: the launcher cannot clean up; the kernel kills the children
        run.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in run.pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in run.pids)
    finally:
        run.close()


def test_stop_processes_escalates_to_sigkill():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    code += "print('ready', flush=True); time.sleep(60)"
    stubborn = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert stubborn.stdout.readline() == "ready\n"
        t0 = time.monotonic()
        assert stop_processes([polite, stubborn], grace=1.0) == [1]
        assert time.monotonic() - t0 < 10
        assert polite.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
    finally:
        for p in (stubborn, polite):
            p.kill()
            p.wait()
        stubborn.stdout.close()


def test_unreachable_coordinator_fails_in_bounded_time(tmp_path):
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "jaxdp.train", "--out", str(tmp_path / "x")]
    cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1"]
    r = _run([*cmd, "--init-timeout", "3"], _env(), timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    err = r.stderr
    assert f"could not reach the coordinator at 127.0.0.1:{port}" in err and "Fix:" in err
    assert "--init-timeout 3 s" in err
    assert not os.path.exists(tmp_path / "x")


def test_launcher_rejects_its_own_flags():
    r = _run(
        [sys.executable, "-m", "jaxdp.launch", "--nproc", "2", "--", "--process-id", "1"],
        _env(),
        timeout=60,
    )
    assert r.returncode == 2 and "--process-id is set by the launcher" in r.stderr


def test_two_processes_as_two_instances_match_one_process(tmp_path, config, cache):
    """num_distributed_optimizer_instances=2 with two processes (two "nodes" of 4 devices):
    the losses of one process on 8 devices with the same setting, bit for bit
    (deterministic_reduction, the main job's default)."""
    n = 4
    hier = ["--set", "num_distributed_optimizer_instances=2", "--set", "zero_stage=2"]
    hier += ["--set", "outer_dp_sharding_strategy=optim", "--steps", str(n)]
    one = str(tmp_path / "one")
    r = _run(
        [sys.executable, "-m", "jaxdp.train", "--config", config, "--out", one, *hier],
        _env(cache),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    two = str(tmp_path / "two")
    launch = [sys.executable, "-m", "jaxdp.launch", "--nproc", "2", "--grace", "60", "--"]
    r = _run([*launch, "--config", config, "--out", two, *hier], _env(cache), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _losses(two) == _losses(one)
    assert _losses(one)[0] == list(range(1, n + 1))
