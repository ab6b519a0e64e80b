"""``python -m jaxdp.launch --nproc P -- <jaxdp-train args>``: P training processes on this
host (see ``_launcher.py``)."""

from ._launcher import main as main
from ._launcher import stop_processes as stop_processes

__all__ = ["main", "stop_processes"]
