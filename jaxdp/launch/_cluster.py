"""Which process of which multi-process job this is: :func:`detect_cluster` reads the launch
conventions of jax, SLURM, Open MPI, Kubernetes (Indexed Job / JobSet), MaxText's GPU scripts and
SkyPilot from the environment.

``jax.distributed.initialize()`` detects SLURM, Open MPI and Kubernetes itself, but not MaxText's
or SkyPilot's variables, not a SLURM batch script's node list, and not one process per node
under SLURM; and when a variable is missing it fails later, at connect time, far from the cause.
``jaxdp-train`` therefore resolves the four arguments here, names the variables it used in its
messages, and passes them explicitly (with jax's own detection off).

Every convention is read by its own function; all that apply are read, the first in
:data:`ORDER` is used, and the others must agree with it on the process count and index (a
job script that exports ``JAX_NUM_PROCESSES=2`` under ``srun --ntasks 4`` is an error, not a
guess). A convention whose variables are only partly set is an error naming what is missing.
Ports: where a convention names none, ``JAX_COORDINATOR_PORT``, else :data:`DEFAULT_PORT`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

from ._nodelist import expand_nodelist

__all__ = ["Cluster", "ClusterError", "DEFAULT_PORT", "detect_cluster", "expand_nodelist"]

#: Coordinator port for conventions that name none (MaxText's), unless JAX_COORDINATOR_PORT.
DEFAULT_PORT = 1234


class Cluster(NamedTuple):
    """Where this process sits in a multi-process job (the arguments of
    ``jax.distributed.initialize``).

    Attributes:
        coordinator: ``HOST:PORT`` of process 0's coordination service.
        num_processes: processes in the job.
        process_id: this process's index, ``0 <= process_id < num_processes``.
        local_device_ids: the local accelerators this process uses (one process per GPU:
            ``(SLURM_LOCALID,)``), or ``None`` for all of this host's (one process per node).
        source: the convention it came from, e.g. ``"SLURM"``, ``"SkyPilot"``, ``"flags"``.

    Example:
        >>> Cluster("node01:1234", 2, 1, None, "flags").coordinator
        'node01:1234'
    """

    coordinator: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None
    source: str


class ClusterError(ValueError):
    """Launch variables that are partly set, malformed or contradict each other."""


Env = Mapping[str, str]


def _get(env: Env, *names: str) -> tuple[str, str] | None:
    """(name, value) of the first of ``names`` set to a non-empty value."""
    for n in names:
        v = env.get(n, "").strip()
        if v:
            return n, v
    return None


def _int(env: Env, name: str, fix: str, *, minimum: int = 0) -> int:
    raw = env[name].strip()
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ClusterError(
            f"{name}={raw!r}: expected an integer >= {minimum}. Fix: {fix}."
        ) from None
    return value


def _need(env: Env, source: str, have: list[str], names: list[str], fix: str) -> None:
    """Raise when some of ``names`` are missing though ``have`` marks the convention as used."""
    missing = [n for n in names if not env.get(n, "").strip()]
    if missing:
        given = ", ".join(f"{n}={env[n]!r}" for n in have if env.get(n, "").strip())
        raise ClusterError(
            f"{source}: {given} set but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; expected all of "
            f"{', '.join(names)}. Fix: {fix}."
        )


def _port(env: Env, default: int = DEFAULT_PORT) -> int:
    if env.get("JAX_COORDINATOR_PORT", "").strip():
        return _int(env, "JAX_COORDINATOR_PORT", "export a free TCP port, e.g. 1234", minimum=1)
    return default


def _check_ids(source: str, n: int, pid: int, names: tuple[str, str], fix: str) -> None:
    if n < 1 or not 0 <= pid < n:
        raise ClusterError(
            f"{source}: {names[1]}={pid} with {names[0]}={n}: expected 0 <= {names[1]} < "
            f"{names[0]}. Fix: {fix}."
        )


def _address(value: str, name: str, fix: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ClusterError(f"{name}={value!r}: expected HOST:PORT, e.g. node01:1234. Fix: {fix}.")
    return value


def _bound_devices(env: Env, per_host: int) -> bool:
    """Whether the launcher already gave each process its own GPUs (CUDA_VISIBLE_DEVICES lists
    fewer devices than there are processes on this host)."""
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    return bool(visible) and len(visible.split(",")) < per_host


def _local_ids(env: Env, per_host: int, local_rank: int) -> tuple[int, ...] | None:
    """One process per GPU: device ``local_rank``; one per host (or GPUs already bound): all."""
    if per_host <= 1 or _bound_devices(env, per_host):
        return None
    return (local_rank,)


# ---------------------------------------------------------------------- conventions
def _jax(env: Env) -> Cluster | None:
    names = ["JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"]
    have = [n for n in names[1:] if env.get(n, "").strip()]
    if not have or (have == ["JAX_NUM_PROCESSES"] and env.get("JOB_COMPLETION_INDEX", "").strip()):
        return None  # (the second: a Kubernetes Indexed Job gives the process id)
    fix = "export JAX_COORDINATOR_ADDRESS=HOST:PORT, JAX_NUM_PROCESSES=P and JAX_PROCESS_ID=I"
    _need(env, "jax", have, names, fix)
    n = _int(env, "JAX_NUM_PROCESSES", fix, minimum=1)
    pid = _int(env, "JAX_PROCESS_ID", fix)
    _check_ids("jax", n, pid, ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"), fix)
    address = _address(env["JAX_COORDINATOR_ADDRESS"].strip(), "JAX_COORDINATOR_ADDRESS", fix)
    ids = None
    if env.get("JAX_LOCAL_DEVICE_IDS", "").strip():
        raw = env["JAX_LOCAL_DEVICE_IDS"]
        try:
            ids = tuple(int(x) for x in raw.split(","))
        except ValueError:
            raise ClusterError(
                f"JAX_LOCAL_DEVICE_IDS={raw!r}: expected comma-separated device numbers, "
                "e.g. 0,1. Fix: correct it or unset it (all local devices)."
            ) from None
    return Cluster(address, n, pid, ids, "jax")


def _maxtext(env: Env) -> Cluster | None:
    if not env.get("JAX_COORDINATOR_IP", "").strip():
        return None
    names = ["JAX_COORDINATOR_IP", "NNODES", "NODE_RANK"]
    fix = "export JAX_COORDINATOR_IP=<node 0's address>, NNODES=N and NODE_RANK=I on every node"
    _need(env, "MaxText", ["JAX_COORDINATOR_IP"], names, fix)
    n = _int(env, "NNODES", fix, minimum=1)
    pid = _int(env, "NODE_RANK", fix)
    _check_ids("MaxText", n, pid, ("NNODES", "NODE_RANK"), fix)
    return Cluster(f"{env['JAX_COORDINATOR_IP'].strip()}:{_port(env)}", n, pid, None, "MaxText")


def _skypilot(env: Env) -> Cluster | None:
    names = ["SKYPILOT_NODE_IPS", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES"]
    have = [n for n in names if env.get(n, "").strip()]
    if not have:
        return None
    fix = "run jaxdp-train from a SkyPilot task's run: section, which sets them on every node"
    _need(env, "SkyPilot", have, names, fix)
    ips = [line.strip() for line in env["SKYPILOT_NODE_IPS"].splitlines() if line.strip()]
    n = _int(env, "SKYPILOT_NUM_NODES", fix, minimum=1)
    pid = _int(env, "SKYPILOT_NODE_RANK", fix)
    if len(ips) != n:
        raise ClusterError(
            f"SkyPilot: SKYPILOT_NUM_NODES={n} but SKYPILOT_NODE_IPS lists {len(ips)} "
            f"address(es) ({', '.join(ips)}); expected one line per node. Fix: {fix}."
        )
    _check_ids("SkyPilot", n, pid, ("SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK"), fix)
    return Cluster(f"{ips[0]}:{_port(env)}", n, pid, None, "SkyPilot")


def _kubernetes(env: Env) -> Cluster | None:
    if not env.get("JOB_COMPLETION_INDEX", "").strip():
        return None
    count = _get(env, "JAX_NUM_PROCESSES", "PROCESSES_IN_JOB")
    jobset = env.get("JOBSET_NAME", "").strip()
    if count is None and not jobset:
        return None  # an Indexed Job of independent one-process runs
    fix = (
        "set JAX_NUM_PROCESSES to the Job's completions (parallelism) and "
        "JAX_COORDINATOR_ADDRESS=<job>-0.<service>:PORT in the pod template (JobSet: "
        "$(JOBSET_NAME)-$(REPLICATED_JOB_NAME)-0-0.$(JOBSET_NAME):PORT)"
    )
    if count is None:
        raise ClusterError(
            f"Kubernetes: JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']!r} and "
            f"JOBSET_NAME={jobset!r} set but not the process count (JAX_NUM_PROCESSES or "
            f"PROCESSES_IN_JOB). Fix: {fix}."
        )
    n = _int(env, count[0], fix, minimum=1)
    pid = _int(env, "JOB_COMPLETION_INDEX", fix)
    if env.get("JOB_INDEX", "0").strip() not in ("", "0"):
        raise ClusterError(
            f"Kubernetes: JOB_INDEX={env['JOB_INDEX']!r}: the JobSet has several replicas of its "
            "replicated job, so JOB_COMPLETION_INDEX is not the process index. Fix: one replica "
            "(replicas: 1) with parallelism = completions = the process count, or set "
            "JAX_PROCESS_ID yourself."
        )
    _check_ids("Kubernetes", n, pid, (count[0], "JOB_COMPLETION_INDEX"), fix)
    if env.get("JAX_COORDINATOR_ADDRESS", "").strip():
        address = _address(env["JAX_COORDINATOR_ADDRESS"].strip(), "JAX_COORDINATOR_ADDRESS", fix)
    elif jobset and env.get("REPLICATED_JOB_NAME", "").strip():
        job = env["REPLICATED_JOB_NAME"].strip()
        address = f"{jobset}-{job}-0-0.{jobset}:{_port(env)}"
    else:
        raise ClusterError(
            f"Kubernetes: JOB_COMPLETION_INDEX={pid} and {count[0]}={n} set but not the "
            "coordinator: expected JAX_COORDINATOR_ADDRESS, or JOBSET_NAME and "
            f"REPLICATED_JOB_NAME (a JobSet). Fix: {fix}."
        )
    return Cluster(address, n, pid, None, "Kubernetes")


def _ompi(env: Env) -> Cluster | None:
    names = ["OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"]
    have = [n for n in names if env.get(n, "").strip()]
    if not have:
        return None
    fix = "start jaxdp-train with mpirun"
    _need(env, "Open MPI", have, names, fix)
    n = _int(env, "OMPI_COMM_WORLD_SIZE", fix, minimum=1)
    pid = _int(env, "OMPI_COMM_WORLD_RANK", fix)
    _check_ids("Open MPI", n, pid, ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), fix)
    addr_fix = (
        "export JAX_COORDINATOR_ADDRESS=<rank 0's host>:PORT to every rank (mpirun -x "
        "JAX_COORDINATOR_ADDRESS=node01:1234)"
    )
    if env.get("JAX_COORDINATOR_ADDRESS", "").strip():
        address = _address(
            env["JAX_COORDINATOR_ADDRESS"].strip(), "JAX_COORDINATOR_ADDRESS", addr_fix
        )
    elif env.get("OMPI_MCA_orte_hnp_uri", "").strip():
        # Open MPI 4: "<jobid>;tcp://IP[,IP...]:PORT" of mpirun's host, as jax reads it
        m = re.search(r"tcp6?://\[?([^,\]:/]+)", env["OMPI_MCA_orte_hnp_uri"])
        if m is None:
            raise ClusterError(
                f"Open MPI: OMPI_MCA_orte_hnp_uri={env['OMPI_MCA_orte_hnp_uri']!r} names no "
                f"tcp:// address. Fix: {addr_fix}."
            )
        address = f"{m.group(1)}:{_port(env)}"
    else:
        raise ClusterError(
            f"Open MPI: OMPI_COMM_WORLD_SIZE={n} and OMPI_COMM_WORLD_RANK={pid} set but not the "
            f"coordinator (JAX_COORDINATOR_ADDRESS, or Open MPI 4's OMPI_MCA_orte_hnp_uri). "
            f"Fix: {addr_fix}."
        )
    ids = None
    if env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "").strip():
        per_host = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", fix, minimum=1)
        if per_host > 1:
            _need(
                env, "Open MPI", ["OMPI_COMM_WORLD_LOCAL_SIZE"], ["OMPI_COMM_WORLD_LOCAL_RANK"], fix
            )
            ids = _local_ids(env, per_host, _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", fix))
    return Cluster(address, n, pid, ids, "Open MPI")


def _tasks_on_node(env: Env, ntasks: int, nnodes: int, fix: str) -> int:
    """Tasks on this node: SLURM's ``8(x2),4`` forms, indexed by SLURM_NODEID."""
    got = _get(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if got is not None:
        counts: list[int] = []
        for part in got[1].split(","):
            m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
            if m is None:
                raise ClusterError(f"{got[0]}={got[1]!r}: expected e.g. 8(x2),4. Fix: {fix}.")
            counts += [int(m.group(1))] * int(m.group(2) or 1)
        node = int(env.get("SLURM_NODEID", "0") or 0)
        return counts[min(node, len(counts) - 1)]
    if env.get("SLURM_NTASKS_PER_NODE", "").strip():
        return _int(env, "SLURM_NTASKS_PER_NODE", fix, minimum=1)
    return -(-ntasks // max(nnodes, 1))


def _slurm(env: Env) -> Cluster | None:
    if not env.get("SLURM_JOB_ID", "").strip() or not env.get("SLURM_PROCID", "").strip():
        return None
    fix = "start jaxdp-train with srun (one task per node or per GPU)"
    tasks = _get(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    n = _int(env, tasks[0], fix, minimum=1) if tasks else 1
    if n <= 1:
        return None
    pid = _int(env, "SLURM_PROCID", fix)
    _check_ids("SLURM", n, pid, (tasks[0] if tasks else "SLURM_NTASKS", "SLURM_PROCID"), fix)
    nodes = _get(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodes is None:
        raise ClusterError(
            f"SLURM: {tasks[0] if tasks else 'SLURM_NTASKS'}={n} but none of "
            "SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set, so the "
            f"coordinator's host is unknown. Fix: {fix}, or pass --coordinator HOST:PORT "
            "--num-processes P --process-id I."
        )
    try:
        hosts = expand_nodelist(nodes[1])
    except ValueError as e:
        raise ClusterError(
            f"{nodes[0]}={nodes[1]!r}: {e}; expected SLURM's host list, e.g. node[01-04,07]. "
            f"Fix: {fix}."
        ) from None
    job = _int(env, "SLURM_JOB_ID", fix)
    port = _port(env, 61440 + job % 4096)  # jax's rule, so both pick the same port
    count = _get(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    nnodes = _int(env, count[0], fix, minimum=1) if count else len(hosts)
    per_node = _tasks_on_node(env, n, nnodes, fix)
    ids = None
    if per_node > 1:
        _need(env, "SLURM", ["SLURM_PROCID"], ["SLURM_LOCALID"], fix)
        if not env.get("SLURM_GPUS_PER_TASK", "").strip():  # srun --gpus-per-task binds them
            ids = _local_ids(env, per_node, _int(env, "SLURM_LOCALID", fix))
    return Cluster(f"{hosts[0]}:{port}", n, pid, ids, "SLURM")


#: Conventions in order of precedence (the first that applies is used; the others must agree).
ORDER: tuple[tuple[str, Callable[[Env], Cluster | None]], ...] = (
    ("jax", _jax),
    ("MaxText", _maxtext),
    ("SkyPilot", _skypilot),
    ("Kubernetes", _kubernetes),
    ("Open MPI", _ompi),
    ("SLURM", _slurm),
)


def detect_cluster(env: Mapping[str, str] | None = None) -> Cluster | None:
    """This process's place in a multi-process job, from the launcher's environment.

    Reads, in this order of precedence: jax's ``JAX_COORDINATOR_ADDRESS`` /
    ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` (and ``JAX_LOCAL_DEVICE_IDS``); MaxText's
    ``JAX_COORDINATOR_IP`` / ``JAX_COORDINATOR_PORT`` / ``NNODES`` / ``NODE_RANK``; SkyPilot's
    ``SKYPILOT_NODE_IPS`` (first line: the head) / ``SKYPILOT_NODE_RANK`` /
    ``SKYPILOT_NUM_NODES``; a Kubernetes Indexed Job or JobSet (``JOB_COMPLETION_INDEX`` with
    ``JAX_NUM_PROCESSES`` or ``PROCESSES_IN_JOB``, and ``JAX_COORDINATOR_ADDRESS`` or JobSet's
    ``JOBSET_NAME`` / ``REPLICATED_JOB_NAME``); Open MPI's ``OMPI_COMM_WORLD_*``; SLURM's
    ``SLURM_JOB_ID`` / ``SLURM_PROCID`` / ``SLURM_NTASKS`` and node list. See
    ``docs/launching.md`` for each.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The :class:`Cluster`, or ``None`` when no convention applies or the job has one process.

    Raises:
        ClusterError: (a ``ValueError``) a convention's variables are partly set or malformed,
            or two conventions disagree on the process count or index.

    Example:
        >>> detect_cluster({"SKYPILOT_NODE_IPS": "10.0.0.5\\n10.0.0.6", "SKYPILOT_NODE_RANK": "1",
        ...                 "SKYPILOT_NUM_NODES": "2"})
        Cluster(coordinator='10.0.0.5:1234', num_processes=2, process_id=1, local_device_ids=None, source='SkyPilot')
    """  # noqa: E501
    env = os.environ if env is None else env
    found = [c for _, read in ORDER if (c := read(env)) is not None]
    if not found:
        if env.get("JAX_COORDINATOR_ADDRESS", "").strip():
            raise ClusterError(
                f"JAX_COORDINATOR_ADDRESS={env['JAX_COORDINATOR_ADDRESS']!r} is set but nothing "
                "says how many processes there are or which one this is. Fix: also export "
                "JAX_NUM_PROCESSES and JAX_PROCESS_ID (or start the job with srun, mpirun, "
                "a Kubernetes Indexed Job or SkyPilot), or unset it for a one-process run."
            )
        return None
    first = found[0]
    for other in found[1:]:
        if (other.num_processes, other.process_id) != (first.num_processes, first.process_id):
            raise ClusterError(
                f"{first.source} says process {first.process_id} of {first.num_processes} but "
                f"{other.source} says process {other.process_id} of {other.num_processes}; "
                f"expected one answer. Fix: unset the {first.source} variables or the "
                f"{other.source} ones (see docs/launching.md), or make them agree."
            )
    return None if first.num_processes == 1 else first
