"""The exposed-communication meter (jaxdp/train/_meter.py): hand-made traces with known answers,
a real XLA:CPU trace of engine steps, and ``jaxdp-train --profile`` end to end."""

import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
import yaml

import jaxdp
from jaxdp.train import _meter
from jaxdp.train._cli import parse_args
from jaxdp.train._meter import (
    StepMeter,
    exposed_communication,
    is_collective,
    meter_json,
    meter_line,
    meter_markdown,
    summarize,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CMD = [sys.executable, "-m", "jaxdp.train"]

# ------------------------------------------------------------------ hand-made traces
# An XLA:GPU-shaped trace: a host process with the step annotations, one process per GPU with
# a compute stream and a collective stream (CUPTI's kernels; no run ids), and an "XLA Ops"
# line the meter must ignore where streams exist. Times in microseconds, as in jax's traces.

HOST, PY = 1, 1
COMPUTE, COMMS, XLA_OPS = 7, 20, 99
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"


def _meta(pid, name, threads):
    out = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}]
    for tid, tname in threads.items():
        out.append(dict(ph="M", pid=pid, tid=tid, name="thread_name", args={"name": tname}))
    return out


def _x(pid, tid, name, ts, end, **args):
    return dict(ph="X", pid=pid, tid=tid, name=name, ts=ts, dur=end - ts, args=args)


def _kernel(gpu, tid, name, ts, end, op, module="jit_step"):
    return _x(100 + gpu, tid, name, ts, end, hlo_op=op, hlo_module=module, correlation_id="1")


def _write(tmp_path, events, gpus=1):
    meta = _meta(HOST, "/host:CPU", {PY: "python"})
    for g in range(gpus):
        meta += _meta(
            100 + g,
            f"/device:GPU:{g}",
            {COMPUTE: "Stream #7(Kernel)", COMMS: "Stream #20(Kernel)", XLA_OPS: "XLA Ops"},
        )
    path = tmp_path / "plugins" / "profile" / "run" / "host.trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": meta + events}, f)
    return str(tmp_path)


def _step(t, compute, collective, gpu=0, step=None, mark_at=None):
    """One step's run starting at ``t`` (us): compute kernels ``[(a, b)]`` on the compute
    stream and NCCL kernels on the collective stream, offsets from ``t``; its annotation
    starts at ``mark_at`` (default ``t``)."""
    ev = [_kernel(gpu, COMPUTE, "first_kernel", t, t + 1, "fusion.0")]
    ev += [
        _kernel(gpu, COMPUTE, "loop_fusion", t + a, t + b, f"fusion.{i + 1}")
        for i, (a, b) in enumerate(compute)
    ]
    ev += [_kernel(gpu, COMMS, NCCL, t + a, t + b, "all-reduce-start.1") for a, b in collective]
    if step is not None and gpu == 0:
        ts = t if mark_at is None else mark_at
        ev.append(_x(HOST, PY, "train", ts - 1, ts, step_num=str(step)))
    return ev


def _one(tmp_path, compute, collective):
    (s,) = exposed_communication(_write(tmp_path, _step(0, compute, collective, step=7)))
    assert s.step == 7 and s.devices == 1
    _identity(s)
    return s


def _identity(s):
    # the device is busy with compute or with exposed communication; the rest is the gap
    assert s.host_gap_ms == pytest.approx(s.wall_ms - s.compute_ms - s.exposed_ms, abs=1e-9)
    assert -1e-9 <= s.exposed_ms <= s.collective_ms + 1e-9


def test_partial_overlap(tmp_path):
    s = _one(tmp_path, compute=[(1, 1000)], collective=[(600, 1600)])
    assert (s.wall_ms, s.compute_ms, s.collective_ms) == pytest.approx((1.6, 1.0, 1.0))
    assert s.exposed_ms == pytest.approx(0.6) and s.overlapped == pytest.approx(0.4)
    assert s.host_gap_ms == pytest.approx(0.0)


def test_full_overlap(tmp_path):
    s = _one(tmp_path, compute=[(1, 2000)], collective=[(500, 1500)])
    assert s.collective_ms == pytest.approx(1.0)
    assert s.exposed_ms == pytest.approx(0.0) and s.overlapped == pytest.approx(1.0)


def test_no_overlap_and_a_gap_inside_the_step(tmp_path):
    # compute to 1 ms, nothing for 0.5 ms, then the collective alone
    s = _one(tmp_path, compute=[(1, 1000)], collective=[(1500, 2000)])
    assert s.exposed_ms == pytest.approx(0.5) == pytest.approx(s.collective_ms)
    assert s.overlapped == pytest.approx(0.0)
    assert s.host_gap_ms == pytest.approx(0.5) and s.wall_ms == pytest.approx(2.0)


def test_concurrent_kernels_count_once_and_no_collective_is_fully_overlapped(tmp_path):
    ev = _step(0, compute=[(1, 1000)], collective=[], step=0)
    ev.append(_kernel(0, COMMS, "other_stream_gemm", 200, 800, "fusion.9"))  # not a collective
    ev.append(_kernel(0, XLA_OPS, "all-reduce-start.1", 0, 5000, "all-reduce-start.1"))  # ignored
    (s,) = exposed_communication(_write(tmp_path, ev))
    assert s.compute_ms == pytest.approx(1.0) and s.collective_ms == 0.0
    assert s.overlapped == 1.0 and s.wall_ms == pytest.approx(1.0)


def test_two_steps_the_idle_device_between_them_is_the_next_steps_gap(tmp_path):
    ev = _step(0, [(1, 1000)], [(600, 1600)], step=3)
    ev += _step(2000, [(1, 1000)], [(500, 1000)], step=4)
    ev.append(_kernel(0, COMPUTE, "copy", 1800, 1900, "copy.1", module="jit_batch"))  # busy too
    steps = exposed_communication(_write(tmp_path, ev))
    assert [s.step for s in steps] == [3, 4]
    first, second = steps
    assert first.wall_ms == pytest.approx(1.6)
    # window 1600 -> 3000: the step runs 2000 -> 3000, the batch copy 1800 -> 1900
    assert second.wall_ms == pytest.approx(1.4)
    assert second.compute_ms == pytest.approx(1.1)
    assert second.exposed_ms == pytest.approx(0.0) and second.collective_ms == pytest.approx(0.5)
    assert second.host_gap_ms == pytest.approx(0.3)
    for s in steps:
        _identity(s)
    summary = summarize(steps)  # the first step is warm-up
    assert summary.steps == 1 and summary.wall_ms == pytest.approx(1.4)


def test_the_host_running_ahead_does_not_shift_the_steps(tmp_path):
    # Both steps are launched (annotated) before the first has run: runs are matched to the
    # steps in order, not by the host's clock.
    ev = _step(1000, [(1, 1000)], [(600, 1600)], step=0, mark_at=10)
    ev += _step(2600, [(1, 1000)], [(900, 1200)], step=1, mark_at=20)
    steps = exposed_communication(_write(tmp_path, ev))
    assert [(s.step, round(s.wall_ms, 6)) for s in steps] == [(0, 1.6), (1, 1.2)]
    assert steps[1].host_gap_ms == pytest.approx(0.0)
    assert steps[1].exposed_ms == pytest.approx(0.2)


def test_devices_are_averaged(tmp_path):
    ev = _step(0, [(1, 1000)], [(600, 1600)], gpu=0, step=0)  # exposed 0.6 ms
    ev += _step(0, [(1, 1000)], [(1000, 1200)], gpu=1)  # exposed 0.2 ms
    (s,) = exposed_communication(_write(tmp_path, ev, gpus=2))
    assert s.devices == 2 and s.exposed_ms == pytest.approx(0.4)


def test_nested_events_on_one_thread_count_their_own_time(tmp_path):
    # XLA:CPU shape: op thunks on host threads, one device per device_ordinal. A while loop
    # [0, 1000] runs a reduce-scatter [200, 600] and a fusion [600, 800]: the loop's own time
    # is compute, the collective inside it is not covered by it.
    def op(name, ts, end, tid=5):
        args = {"hlo_op": name, "hlo_module": "jit_step", "device_ordinal": "0", "run_id": "9"}
        return _x(HOST, tid, name, ts, end, **args)

    ev = _meta(HOST, "/host:CPU", {PY: "python", 5: "tf_XLAPjRtCpuClient/1"})
    ev += [
        op("while.2", 0, 1000),
        op("reduce_scatter.3", 200, 600),
        op("fusion.4", 600, 800),
        _x(HOST, 5, "Rendezvous", 210, 590),  # no hlo_op: not an op
        _x(HOST, PY, "train", -5, 0, step_num="1"),
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    (s,) = exposed_communication(str(path))
    got = (s.wall_ms, s.compute_ms, s.collective_ms, s.exposed_ms)
    assert got == pytest.approx((1.0, 0.6, 0.4, 0.4))
    assert s.devices == 1


@pytest.mark.parametrize(
    "name, op, expected",
    [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", None, True),
        ("ncclKernel_ReduceScatter_RING_SIMPLE_Sum_float", None, True),
        ("all-reduce-start.3", None, True),
        ("reduce_scatter.15", None, True),
        ("all-gather.1", None, True),
        ("all-to-all.2", None, True),
        ("collective-permute-done.4", None, True),
        ("send.5", None, True),
        ("recv-done.5", None, True),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "fusion.12", False),
        ("input_reduce_fusion", "reduce.7", False),
        ("sender_fusion", None, False),
        ("MemcpyD2D", None, False),
        ("loop_convert_fusion", "all-gather-start.1", True),
    ],
)
def test_is_collective(name, op, expected):
    assert is_collective(name, op) is expected


def test_reports(tmp_path):
    steps = [
        StepMeter(1, 10.0, 6.0, 4.0, 3.0, 1.0, 2),
        StepMeter(2, 10.0, 6.0, 4.0, 1.0, 3.0, 2),
        StepMeter(3, 12.0, 8.0, 4.0, 2.0, 2.0, 2),
    ]
    s = summarize(steps)
    assert (s.steps, s.wall_ms, s.exposed_ms) == (2, 11.0, 1.5)
    assert s.overlapped == pytest.approx(1 - 1.5 / 4)
    assert meter_line(s).startswith("collectives 4 ms/step, exposed 1.5 ms (62% overlapped)")
    j = json.loads(json.dumps(meter_json(steps, trace="x.trace.json.gz")))
    assert j["summary"]["steps"] == 2 and [r["step"] for r in j["steps"]] == [1, 2, 3]
    assert j["steps"][0]["overlapped"] == pytest.approx(0.25)
    md = meter_markdown(steps)
    assert md.count("\n") == 5 and "| median | 11.000 |" in md
    with pytest.raises(ValueError, match="no steps were measured"):
        summarize([])


def test_bad_input_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \*\.trace\.json\.gz under"):
        exposed_communication(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="neither a trace file nor a folder"):
        exposed_communication(str(tmp_path / "missing"))
    path = _write(tmp_path, _step(0, [(1, 10)], [], step=0))
    with pytest.raises(ValueError, match=r"module='nope' matches no XLA module.*jit_step"):
        exposed_communication(path, module="nope")
    assert len(exposed_communication(path, module="step")) == 1


# ------------------------------------------------------------------ a real XLA:CPU trace


def test_a_cpu_trace_of_engine_steps(tmp_path):
    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    mesh = jaxdp.make_mesh(jax.devices()[:4])
    cfg = jaxdp.DDPConfig(zero_stage=1, bucket_size=2048)  # a few buckets, a few collectives
    engine = jaxdp.DataParallel(loss_fn, optax.adam(1e-3), cfg, mesh=mesh)
    state = engine.init({"w1": jnp.full((32, 64), 0.01), "w2": jnp.full((64, 4), 0.01)})
    batch = engine.shard_batch({"x": jnp.ones((16, 32)), "y": jnp.ones((16, 4))})
    state, _ = engine.step(state, batch)  # compile outside the trace
    jax.block_until_ready(state)
    jax.profiler.start_trace(str(tmp_path))
    for i in range(3):
        with jax.profiler.StepTraceAnnotation("train", step_num=10 + i):
            state, _ = engine.step(state, batch)
    jax.block_until_ready(state)
    jax.profiler.stop_trace()

    steps = exposed_communication(str(tmp_path))
    assert [s.step for s in steps] == [10, 11, 12]
    for s in steps:
        assert s.devices == 4
        assert s.compute_ms > 0 and s.collective_ms > 0
        _identity(s)
    assert summarize(steps).steps == 2

    # Without run ids (as on GPUs) the runs are found from the program's first op: the same.
    trace = _meter.find_trace(str(tmp_path))
    with gzip.open(trace, "rt") as f:
        data = json.load(f)
    for e in data["traceEvents"]:
        e.get("args", {}).pop("run_id", None)
    stripped = tmp_path / "stripped.trace.json.gz"
    with gzip.open(stripped, "wt") as f:
        json.dump(data, f)
    assert exposed_communication(str(stripped)) == steps


# ------------------------------------------------------------------ jaxdp-train --profile


def test_the_profile_flag(capsys):
    assert parse_args(["--profile"]).profile == 5 and parse_args([]).profile is None
    with pytest.raises(SystemExit):
        parse_args(["--profile", "0"])
    assert "--profile 0: expected a number of steps >= 1" in capsys.readouterr().err


def test_jaxdp_train_profile(tmp_path):
    cfg = {
        "model": {"layers": 1, "width": 32, "heads": 2, "context": 16},
        "train": {
            "steps": 4,
            "global_batch": 8,
            "micro_batch": 2,
            "log_every": 2,
            "eval_every": 100,
            "eval_batches": 1,
            "checkpoint_every": 100,
            "sample_bytes": 0,
            "warmup": 1,
            "decay_steps": 10,
        },
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [*CMD, "--config", str(path), "--out", str(out), "--devices", "2", "--profile", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out / "profile" / "meter.json") as f:
        meter = json.load(f)
    assert [s["step"] for s in meter["steps"]] == [3, 4]  # from the third step
    assert all(s["devices"] == 2 and s["collective_ms"] > 0 for s in meter["steps"])
    assert meter["summary"]["steps"] == 1
    assert os.path.exists(out / "profile" / meter["trace"])
    text = " ".join(r.stdout.split())  # rich wraps lines
    assert "exposed communication (" in text and "ms/step, exposed" in text
    with open(out / "summary.json") as f:
        assert json.load(f)["exposed_communication"] == meter["summary"]
