"""``python -m jaxdp.launch --nproc P -- <jaxdp-train args>``: P training processes on this host.

Each process is ``python -m jaxdp.train <args> --coordinator 127.0.0.1:PORT --num-processes P
--process-id I`` with its own share of the devices: on a machine without accelerators each gets
``--devices-per-process`` simulated CPU devices (default ``8 // P``, so the run has 8 devices
as a one-process run does), and the processes talk through ``jax.distributed`` with gloo CPU
collectives. Process 0's output is shown; the others write ``OUT/logs/process_I.log`` (shown
if they fail). If any process fails, the rest are stopped and its exit status is returned.

Example::

    python -m jaxdp.launch --nproc 2 -- --steps 50 --out runs/two-procs
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Any

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _out_dir(train_args: list[str]) -> str:
    for i, a in enumerate(train_args):
        if a == "--out" and i + 1 < len(train_args):
            return train_args[i + 1]
        if a.startswith("--out="):
            return a.split("=", 1)[1]
    return "runs/jaxdp-train"


def main(argv: list[str] | None = None) -> int:
    """Start the processes, wait for them, return the first failure's exit status (or 0)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, train_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(prog="python -m jaxdp.launch", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=int, help="simulated CPU devices per process")
    p.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    args = p.parse_args(ours)
    if args.nproc < 1:
        p.error(f"--nproc {args.nproc}: expected a positive number of processes, e.g. --nproc 2")
    bad = [
        a
        for a in train_args
        if a.split("=")[0] in ("--coordinator", "--num-processes", "--process-id")
    ]
    if bad:
        p.error(f"{bad[0]} is set by the launcher; remove it from the training arguments")
    per = args.devices_per_process or max(8 // args.nproc, 1)
    port = args.port or _free_port()
    logs = os.path.join(_out_dir(train_args), "logs")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={per}"])
    procs: list[subprocess.Popen[bytes]] = []
    files: list[Any] = []
    for i in range(args.nproc):
        cmd = [
            sys.executable, "-m", "jaxdp.train", *train_args,
            "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", str(args.nproc),
            "--process-id", str(i),
        ]  # fmt: skip
        if i == 0:
            procs.append(subprocess.Popen(cmd, env=env))
            files.append(None)
        else:
            f = open(os.path.join(logs, f"process_{i}.log"), "w")  # noqa: SIM115 - kept open
            files.append(f)
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
    status = 0
    try:
        while any(q.poll() is None for q in procs):
            failed = [q for q in procs if q.poll() not in (None, 0)]
            if failed:
                status = failed[0].returncode
                break
            time.sleep(0.2)
        else:
            status = next((q.returncode for q in procs if q.returncode), 0)
    finally:
        for q in procs:
            if q.poll() is None:
                q.terminate()
        for q in procs:
            try:
                q.wait(timeout=30)
            except subprocess.TimeoutExpired:
                q.kill()
        for f in files:
            if f is not None:
                f.close()
    if status:
        for i in range(1, args.nproc):
            path = os.path.join(logs, f"process_{i}.log")
            with open(path) as f:
                tail = f.read()[-2000:]
            print(f"--- process {i} ({path}), last lines:\n{tail}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
