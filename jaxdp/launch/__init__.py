"""``python -m jaxdp.launch --nproc P -- <jaxdp-train args>``: P training processes on this host,
with a hang watchdog; and :func:`detect_cluster`, the launch conventions of clusters.

See ``docs/launching.md``: SLURM, Open MPI, Kubernetes (Indexed Job / JobSet), MaxText's and
SkyPilot's variables, and what the hang watchdog (``--hang-timeout``) can and cannot catch.
"""

from ._cluster import Cluster as Cluster
from ._cluster import ClusterError as ClusterError
from ._cluster import detect_cluster as detect_cluster
from ._launcher import main as main
from ._launcher import stop_processes as stop_processes

__all__ = ["Cluster", "ClusterError", "detect_cluster", "main", "stop_processes"]
