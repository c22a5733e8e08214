"""The aggregator actor's replies (no torch, no Ray): what `register` and `ingest` acknowledge (`Ack`), and
what `health` and `ranks` answer (`AggregatorHealth`, `RankHealth`). The engine and the ingress read them by
field; the ingress's /health and /stats/ranks show them as JSON objects with the same names, in this order.
Records (`query`, `wait_records`, `kv_cache_stats`) stay the spec's JSON-shaped dicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Ack:
    """The reply of `register` and `ingest`: the aggregator's epoch (one higher after each restart), the newest
    iteration a saved record holds (None: none yet; the engine may forget everything up to it), and the
    session of the engine attached last."""

    epoch: int
    acked: int | None
    session: int


@dataclass(frozen=True)
class RankHealth:
    """One rank as the aggregator last heard from it: healthy = reported in the newest record; `record` is its
    own latest record (None before its first)."""

    rank: int
    dp_rank: int
    tp_rank: int
    incarnation: str | None
    last_seen: float | None
    age_s: float | None
    healthy: bool
    node_id: str | None
    node_ip: str | None
    record: dict[str, Any] | None


@dataclass(frozen=True)
class AggregatorHealth:
    """The aggregator's state: the /health `aggregator` object (the ingress adds what its mirror holds)."""

    ok: bool
    engine_id: str
    epoch: int
    world_size: int
    tp: int
    last_iter: int | None
    buffered: int
    oldest_buffered_iter: int | None
    buffer_size: int
    healthy_ranks: int
    counts: dict[str, int]
    uptime_s: float
