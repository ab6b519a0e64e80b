"""What a collective costs on the wire: the alpha-beta model of a link, ring collective times, and
the bucket size it implies when a job spans several nodes.

A :class:`Link` is a per-step latency ``alpha_s`` and a per-GPU, per-direction bandwidth
``beta_bytes_per_s``. A ring collective over ``n`` ranks of a bucket of ``B`` bytes (the whole
bucket: a reduce-scatter's input, an all-gather's output) takes

* reduce-scatter, all-gather: ``(n - 1) * alpha + (n - 1) / n * B / beta``;
* all-reduce (a reduce-scatter, then an all-gather): twice that.

A ring that spans ``m`` nodes of ``n / m`` GPUs (:func:`ring_link`) moves every byte over the
inter-node link (each rank's share crosses it once per step), so its bandwidth is the network's;
of its ``n - 1`` steps, ``m - 1`` wait on the network's latency and the others on NVLink's (the
split of NCCL's own tuning model, ``src/graph/tuning.cc``).

The defaults (:data:`NVLINK`, :data:`INFINIBAND`) are public figures of an 8-GPU NVSwitch node
with one 400 Gb/s NIC per GPU: NVLink 4 at 450 GB/s per direction per GPU, InfiniBand NDR at
50 GB/s per GPU; the latencies are NCCL's tuning model's per-step latencies of a ring with its
Simple protocol (3.4 us over NVLink, 9.6 us over the network). Measured bus bandwidths are
lower (an 8-GPU reduce-scatter reaches about 310-360 GB/s), so the model's times are lower
bounds; docs/gpu-and-xla-flags.md writes the model out, BENCHMARKS.md section 14 applies it.

The bucket size rule (:func:`auto_bucket_bytes`, ``bucket_size="auto"`` across nodes): with
``k = S / s`` buckets of ``s`` bytes out of ``S``, each collective pays its latency ``L`` once,
and the last bucket's collective cannot overlap the backward pass (nothing is left to compute
when it starts). The exposed time ``(k - 1) * L + (L + s / b)`` (``b``: the bytes of a bucket
per second of transfer) is smallest at ``s = sqrt(S * L * b)``; a bucket is kept at least as
large as ``10 * L * b``, where its latency is a tenth of its transfer time, and no larger than
Megatron's default, the single-node rule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any, Final

__all__ = [
    "INFINIBAND",
    "LATENCY_SHARE",
    "NVLINK",
    "BucketChoice",
    "Link",
    "all_gather_time",
    "all_reduce_time",
    "auto_bucket_bytes",
    "collective_time",
    "nodes_of",
    "reduce_scatter_time",
    "ring_link",
]


@dataclasses.dataclass(frozen=True)
class Link:
    """An alpha-beta model of one link.

    Attributes:
        alpha_s: latency of one step of a ring collective, seconds.
        beta_bytes_per_s: bandwidth per GPU and direction, bytes per second.
        name: what it is called in reports.

    Example:
        >>> Link(5e-6, 100e9, "test").alpha_s
        5e-06
    """

    alpha_s: float
    beta_bytes_per_s: float
    name: str = "link"

    def __post_init__(self) -> None:
        for field, v in (("alpha_s", self.alpha_s), ("beta_bytes_per_s", self.beta_bytes_per_s)):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v < 0 or (field == "beta_bytes_per_s" and v == 0):
                raise ValueError(
                    f"Link.{field}: got {v!r}; expected a finite number "
                    f"{'> 0' if field == 'beta_bytes_per_s' else '>= 0'} (seconds, bytes per "
                    "second). Fix: e.g. Link(alpha_s=10e-6, beta_bytes_per_s=50e9)."
                )


#: NVLink 4 through NVSwitch: 450 GB/s per direction per GPU; 3.4 us per ring step.
NVLINK: Final = Link(3.4e-6, 450e9, "NVLink")
#: InfiniBand NDR, one 400 Gb/s NIC per GPU: 50 GB/s; 9.6 us per ring step over the network.
INFINIBAND: Final = Link(9.6e-6, 50e9, "InfiniBand")
#: The bucket size rule keeps a bucket's latency at most this share of its transfer time.
LATENCY_SHARE: Final = 0.1


def _ranks(n: Any, what: str = "ranks") -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what}={n!r}; expected an int >= 1")
    return n


def ring_link(nodes: int, per_node: int, intra: Link = NVLINK, inter: Link = INFINIBAND) -> Link:
    """The link one flat ring over ``nodes`` x ``per_node`` GPUs behaves as: the network's
    bandwidth, and a latency per step averaged over its ``n - 1`` steps, ``nodes - 1`` of which
    cross the network. One node: ``intra`` itself.

    Example:
        >>> two = ring_link(2, 8)
        >>> two.beta_bytes_per_s == INFINIBAND.beta_bytes_per_s
        True
        >>> round(two.alpha_s * 15 * 1e6, 1)  # 14 NVLink steps + 1 network step, in us
        57.2
    """
    nodes, per_node = _ranks(nodes, "nodes"), _ranks(per_node, "per_node")
    if nodes == 1:
        return intra
    n = nodes * per_node
    alpha = ((n - nodes) * intra.alpha_s + (nodes - 1) * inter.alpha_s) / (n - 1)
    return Link(alpha, inter.beta_bytes_per_s, f"{inter.name} ({nodes} nodes)")


def reduce_scatter_time(nbytes: float, ranks: int, link: Link) -> float:
    """Seconds a ring reduce-scatter of ``nbytes`` (the whole input) takes over ``ranks``.

    Example:
        >>> round(reduce_scatter_time(1e9, 8, Link(1e-5, 100e9)) * 1e3, 3)  # 7e-5 + 8.75e-3
        8.82
    """
    n = _ranks(ranks)
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes / link.beta_bytes_per_s


def all_gather_time(nbytes: float, ranks: int, link: Link) -> float:
    """Seconds a ring all-gather of ``nbytes`` (the whole output) takes: a reduce-scatter's."""
    return reduce_scatter_time(nbytes, ranks, link)


def all_reduce_time(nbytes: float, ranks: int, link: Link) -> float:
    """Seconds a ring all-reduce of ``nbytes`` takes: a reduce-scatter, then an all-gather.

    Example:
        >>> all_reduce_time(1e9, 8, NVLINK) == 2 * reduce_scatter_time(1e9, 8, NVLINK)
        True
    """
    return 2 * reduce_scatter_time(nbytes, ranks, link)


def collective_time(kind: str, nbytes: float, ranks: int, link: Link) -> tuple[float, float]:
    """``(latency, transfer)`` seconds of one ``kind`` (``"all-reduce"``, ``"reduce-scatter"``
    or ``"all-gather"``) collective of ``nbytes``; their sum is its time."""
    per_step = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1}.get(kind)
    if per_step is None:
        raise ValueError(
            f"collective_time: kind={kind!r}; expected 'all-reduce', 'reduce-scatter' or "
            "'all-gather'"
        )
    n = _ranks(ranks)
    latency = per_step * (n - 1) * link.alpha_s
    return latency, per_step * (n - 1) / n * nbytes / link.beta_bytes_per_s


def auto_bucket_bytes(
    total_bytes: float,
    ranks: int,
    link: Link,
    *,
    kind: str = "reduce-scatter",
    largest_bytes: float,
    latency_share: float = LATENCY_SHARE,
) -> int:
    """The bucket size (bytes) that minimises the model's exposed reduction time (module
    docstring): ``sqrt(S * L * b)``, at least ``L * b / latency_share``, at most
    ``largest_bytes`` (Megatron's default).

    Example:
        >>> s = auto_bucket_bytes(0.61e9, 16, ring_link(2, 8), largest_bytes=80e6)
        >>> round(s / 1e6, 1)  # MB, under the 80 MB default
        43.1
    """
    if total_bytes <= 0:
        return int(largest_bytes)
    latency, transfer = collective_time(kind, 1.0, ranks, link)  # transfer: seconds per byte
    if latency == 0:
        return int(largest_bytes)
    per_s = 1.0 / transfer  # bucket bytes per second of transfer
    best = math.sqrt(total_bytes * latency * per_s)
    floor = latency * per_s / latency_share
    return int(min(largest_bytes, max(best, floor)))


@dataclasses.dataclass(frozen=True)
class BucketChoice:
    """How a layout's bucket size was chosen and what the link model predicts for it.

    Attributes:
        rule: ``"auto"`` (Megatron's default), ``"auto, alpha-beta"`` (across nodes),
            ``"num_buckets"``, ``"bucket_size"`` (given) or ``"one per buffer"``.
        link: the link the model priced the collectives on.
        kind: the gradient collective (``"all-reduce"`` or ``"reduce-scatter"``).
        ranks: its ranks.
        bucket_bytes: the gradient bytes of each bucket, in layout order.
        latency_s: the model's latency of all of them, seconds.
        transfer_s: the model's transfer time of all of them, seconds.
    """

    rule: str
    link: Link
    kind: str
    ranks: int
    bucket_bytes: tuple[int, ...]
    latency_s: float
    transfer_s: float

    @classmethod
    def price(
        cls, rule: str, link: Link, kind: str, ranks: int, bucket_bytes: Iterable[int]
    ) -> BucketChoice:
        """The model's times for ``bucket_bytes`` reduced by ``kind`` over ``ranks``."""
        sizes = tuple(int(b) for b in bucket_bytes)
        parts = [collective_time(kind, b, ranks, link) for b in sizes]
        return cls(
            rule,
            link,
            kind,
            ranks,
            sizes,
            sum(p[0] for p in parts),
            sum(p[1] for p in parts),
        )

    @property
    def exposed_s(self) -> float:
        """The model's exposed time when compute hides nothing but the last bucket's wait:
        every latency, plus the last bucket's transfer."""
        if not self.bucket_bytes or self.ranks == 1:
            return 0.0
        last = collective_time(self.kind, self.bucket_bytes[-1], self.ranks, self.link)[1]
        return self.latency_s + last

    def describe(self) -> str:
        """One line for a start-up report: the buckets, the rule that sized them, and the
        model's time for one reduction of all of them (of which latency).

        Example:
            >>> c = BucketChoice.price("auto", NVLINK, "reduce-scatter", 8, [80e6] * 4)
            >>> c.describe()
            'buckets: 4 x 80 MB (auto; NVLink model: 0.72 ms per reduce-scatter, 0.10 ms latency)'
        """
        sizes = self.bucket_bytes
        if not sizes:
            return "buckets: none"
        mb = sorted({round(b / 1e6) for b in sizes})
        size = f"{mb[0]} MB" if len(mb) == 1 else f"{mb[0]}-{mb[-1]} MB"
        return (
            f"buckets: {len(sizes)} x {size} ({self.rule}; {self.link.name} model: "
            f"{1e3 * (self.latency_s + self.transfer_s):.2f} ms per {self.kind}, "
            f"{1e3 * self.latency_s:.2f} ms latency)"
        )


def nodes_of(devices: Sequence[Any]) -> int:
    """How many nodes ``devices`` span, counted as the processes that own them: jaxdp's
    launchers start one process per node or one per GPU; with one per GPU this counts every
    GPU as a node, which prices every ring step on the network (the model's worst case)."""
    return len({getattr(d, "process_index", 0) for d in devices}) or 1
