"""The exposed-communication meter on the main job: ``jaxdp-train --profile`` on CPU devices.

Runs ``jaxdp-train`` (the default model, 8 simulated CPU devices) at ZeRO stages 1 and 3 with
``--profile`` and reports what ``OUT/profile/meter.json`` says per step (medians): compute,
collective and exposed-collective time, the overlapped fraction and the host gap, next to the
step time the run logged outside the trace. A smoke check of the meter on real traces; the
overlap figures that matter come from GPUs (``bench/bench_gpu.py --main-job-profile``).

Run: python bench/bench_meter.py
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import _harness as H

STAGES = (1, 3)


def run(stage: int, quick: bool) -> dict[str, Any]:
    """One ``jaxdp-train --profile`` run in a child process: its meter and the step time of
    its last logged steps, which come after the traced ones (steps 3-7 traced, 9-12 logged)."""
    with tempfile.TemporaryDirectory(prefix="jaxdp-bench-meter-") as out:
        steps, traced, every = (6, 2, 2) if quick else (12, 5, 4)
        args = ["-m", "jaxdp.train", "--out", out, "--steps", str(steps)]
        args += ["--profile", str(traced), "--zero-stage", str(stage)]
        args += ["--set", "train.sample_bytes=0", "--set", "train.eval_batches=1"]
        args += ["--set", f"train.log_every={every}"]
        if quick:
            args += ["--set", "model.layers=1", "--set", "model.width=32", "--set", "model.heads=2"]
            args += ["--set", "model.context=16", "--set", "train.global_batch=16"]
            args += ["--set", "train.micro_batch=2"]
        env = H.cpu_devices(8) or {"JAX_PLATFORMS": "cpu"}  # run_all: its flags pass on
        path = os.pathsep.join([H.ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
        proc = H.python(args, {**env, "PYTHONPATH": path}, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"jaxdp-train exited {proc.returncode}: {proc.stderr[-2000:]}")
        with open(os.path.join(out, "profile", "meter.json")) as f:
            meter = json.load(f)
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            last = [json.loads(line) for line in f][-1]
        tokens_per_step = summary["tokens_per_s"] * summary["step_time_s"]
        cmd = "jaxdp-train " + " ".join(args[2:]).replace(out, "OUT")
        step_ms = 1e3 * tokens_per_step / last["tokens_per_s"]
    return {"stage": stage, "meter": meter, "step_ms": step_ms, "cmd": cmd}


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    runs = []
    for stage in STAGES[:1] if quick else STAGES:
        r = run(stage, quick)
        runs.append(r)
        m = r["meter"]["summary"]
        print(f"stage {stage}: {m} (step {r['step_ms']:.0f} ms outside the trace)", flush=True)
    rows = []
    for r in runs:
        m = r["meter"]["summary"]
        rows.append(
            (
                f"ZeRO {r['stage']}",
                f"{r['step_ms']:.0f}",
                f"{m['wall_ms']:.0f}",
                f"{m['compute_ms']:.1f}",
                f"{m['collective_ms']:.1f}",
                f"{m['exposed_ms']:.1f}",
                f"{m['overlapped']:.0%}",
                f"{m['host_gap_ms']:.0f}",
                m["steps"],
            )
        )
    header = [
        "run",
        "step ms (untraced)",
        "step ms (traced)",
        "compute ms",
        "collective ms",
        "exposed ms",
        "overlapped",
        "host gap ms",
        "steps",
    ]
    cmds = "\n".join(r["cmd"] for r in runs)
    md = (
        "`OUT/profile/meter.json` of the main job on 8 simulated CPU devices: medians per step "
        "over the traced steps after the first; the untraced step time is that of the run's "
        f"last logged steps (`metrics.jsonl`), after the trace.\n\n{H.table(header, rows)}\n\n"
        f"```\n{cmds}\n```"
    )
    return {"runs": runs, "markdown": md}


def reading(res: dict[str, Any]) -> str:
    runs = res["runs"]
    ratios = [r["meter"]["summary"]["wall_ms"] / r["step_ms"] for r in runs]
    share = min(1 - r["meter"]["summary"]["overlapped"] for r in runs)
    return H.reading("bench_meter", lo=min(ratios), hi=max(ratios), share=share)


if __name__ == "__main__":
    res = result()
    print(res["markdown"])
    print(reading(res))
