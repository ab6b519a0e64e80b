"""The hang watchdogs' parts, without training: progress files, the launcher's view (who is
behind, a stopped process), the in-process thread (a process busy in Python), process-group
signals, and XLA's NCCL termination timeout. The end-to-end runs are in test_launch.py."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxdp.launch import stop_processes
from jaxdp.launch._progress import Progress, Report, describe, read_report
from jaxdp.launch._watchdog import HANG_STATUS, InProcessWatchdog, LauncherWatch, process_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_progress_file_round_trip_and_order(tmp_path):
    path = str(tmp_path / "progress_0")
    p = Progress(path)
    assert read_report(path) == Report(0, "setup")
    p.report(12, "checkpoint")
    assert read_report(path) == Report(12, "checkpoint") and p.last == Report(12, "checkpoint")
    assert os.path.getsize(path) == 64  # rewritten in place, never longer
    p.close()
    assert read_report(str(tmp_path / "missing")) is None
    order = [Report(0, "setup"), Report(1, "step"), Report(1, "eval"), Report(1, "checkpoint")]
    order += [Report(1, "finished"), Report(2, "step"), Report(2, "end")]
    assert sorted(order, key=Report.key) == order
    assert describe(Report(10, "finished")) == "after step 10 (step 11 not started)"


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_launcher_watch_names_the_process_behind(tmp_path):
    paths = [str(tmp_path / f"progress_{i}") for i in range(3)]
    reports = [Progress(p) for p in paths]
    watch = LauncherWatch(paths, timeout=0.3)
    assert not watch.poll([True] * 3)
    for r, step in zip(reports, (11, 10, 11), strict=True):
        r.report(step, "step")
    assert not watch.poll([True] * 3)
    time.sleep(0.4)
    assert watch.poll([True] * 3)  # nobody reported for 0.3 s
    procs = [_sleeper() for _ in range(3)]
    try:
        pids = [q.pid for q in procs]
        msg = watch.message(pids, [True] * 3)
        assert f"process 1 (pid {pids[1]}) made no progress since step 10: last report in " in msg
        assert f"process 0 (pid {pids[0]}): last report in step 11" in msg
        # a stopped process is the one behind, whatever its step
        os.kill(pids[2], signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(pids[2]) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        msg = watch.message(pids, [True] * 3)
        assert f"process 2 (pid {pids[2]}) made no progress since step 11" in msg
        assert "It is stopped (SIGSTOP" in msg
        # one that made progress a moment ago keeps the run alive
        reports[0].report(12, "step")
        assert not watch.poll([True] * 3)
        # processes that exited are not waited for
        time.sleep(0.4)
        assert not watch.poll([False] * 3)
    finally:
        for q in procs:
            q.kill()
            q.wait()


def test_equally_far_processes_are_all_named(tmp_path):
    paths = [str(tmp_path / f"progress_{i}") for i in range(2)]
    for p in paths:
        Progress(p).report(7, "step")
    watch = LauncherWatch(paths, timeout=0.1)
    watch.poll([True, True])
    msg = watch.message([os.getpid(), os.getpid()], [True, True])
    assert "process 0" in msg and "process 1" in msg and "Every process got equally far" in msg


def test_in_process_watchdog_fires_once_progress_stops(tmp_path):
    exits = []
    p = Progress()
    p.report(3, "step")
    err = open(tmp_path / "stderr", "w")  # noqa: SIM115 - closed below
    with InProcessWatchdog(p, timeout=0.5, exit=exits.append, stream=err) as dog:
        t0 = time.monotonic()
        while not exits and time.monotonic() - t0 < 10:
            time.sleep(0.05)
    err.close()
    assert exits == [HANG_STATUS]
    assert 0.5 <= time.monotonic() - t0 < 0.5 + 3 * dog.poll_s + 1
    text = (tmp_path / "stderr").read_text()
    assert "process 0 of 1 made no progress since step 3 for" in text and "in step 3" in text
    assert "most recent call first" in text and "in test_in_process_watchdog_fires" in text


def test_in_process_watchdog_keeps_quiet_while_progress_is_made():
    exits = []
    p = Progress()
    with InProcessWatchdog(p, timeout=0.5, exit=exits.append):
        for step in range(15):
            p.report(step, "step")
            time.sleep(0.1)
    assert exits == []


def test_a_process_busy_in_python_dumps_its_stack_and_exits():
    code = textwrap.dedent(
        """
        from jaxdp.launch._progress import Progress
        from jaxdp.launch._watchdog import InProcessWatchdog
        p = Progress()
        p.report(5, "finished")
        def spin_forever():
            while True:
                pass
        with InProcessWatchdog(p, timeout=1.0):
            spin_forever()
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == HANG_STATUS, r.stderr[-3000:]
    assert "process 0 of 1 made no progress since step 5 for" in r.stderr
    assert "after step 5 (step 6 not started)" in r.stderr
    assert "in spin_forever" in r.stderr  # the main thread's stack, from faulthandler
    assert time.monotonic() - t0 < 60


def test_stop_processes_continues_stopped_ones_and_ends_their_groups():
    # a leader with a child in its own process group, stopped: SIGTERM alone would wait
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    code += "'import time; time.sleep(60)']); print('ready', flush=True); time.sleep(60)"
    q = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert q.stdout.readline() == "ready\n"
        os.kill(q.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert stop_processes([q], grace=20.0) == []  # ended by SIGTERM, not killed
        assert time.monotonic() - t0 < 10 and q.returncode == -signal.SIGTERM
        with pytest.raises(ProcessLookupError):  # the group is gone, grandchild included
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                os.killpg(q.pid, 0)
                time.sleep(0.05)
    finally:
        if q.poll() is None:
            q.kill()
            q.wait()
        q.stdout.close()


def test_nccl_termination_timeout_is_armed_where_a_gpu_may_be_used(monkeypatch):
    from jaxdp._src.platform.xla_flag_table import flag_available
    from jaxdp.train._processes import arm_nccl_timeout

    name = "xla_gpu_nccl_termination_timeout_seconds"
    assert flag_available(name)  # the installed jaxlib has it (test_xla_flags starts XLA with it)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("JAX_PLATFORMS", "")
    arm_nccl_timeout(90.5)
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=8",
        f"--{name}=90",
    ]
    arm_nccl_timeout(30)  # already set (by the user or before): left alone
    assert os.environ["XLA_FLAGS"].count(name) == 1
    monkeypatch.setenv("XLA_FLAGS", "")
    arm_nccl_timeout(0)  # the watchdog is off
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # a GPU flag on a CPU-only run: pointless
    arm_nccl_timeout(60)
    assert os.environ["XLA_FLAGS"] == ""
