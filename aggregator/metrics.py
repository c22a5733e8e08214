"""Prometheus text for one engine's KV cache statistics, rendered with prometheus-client at scrape time.

A fresh registry with one custom collector is built from a snapshot of the aggregator's state on each
scrape, so nothing here holds state and nothing is double-registered across actor restarts. `METRICS` below
is the list of every series (the Grafana dashboard and the k8s monitoring manifests read it).

Sources: cluster cumulative counters (`kvfleet_kv_cache_*_total` without labels) come from the cluster
`kvCacheStats`, which never goes backwards. Per-window / per-pool-group counters are sums over every record
emitted, saved with the aggregator's checkpoint: a restarted aggregator continues them (no counter reset), as
it does the record counts and completed requests; only the routing sums are this epoch's. Gauges come from
the newest record. Per-rank series come from each rank's newest message and restart with the rank's
incarnation.
"""

from __future__ import annotations

import re
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from aggregator.fields import (
    KV_STATS_COUNTERS,
    KV_STATS_GAUGES,
    POOL_VIEW,
    ROUTING_COUNTERS,
    VIEW_COUNTERS,
    WINDOW_VIEW,
    hit_rate,
)

RANK_LABELS = ("rank", "dp_rank", "tp_rank")
_GAUGE_STATES = ("max", "free", "used", "evictable", "peak_free", "peak_used", "peak_evictable")


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def _iter_name(field: str) -> str:
    """iterOnboardBytes -> onboard_bytes"""
    return _snake(field[len("iter"):])


def _gauge_field(tier: str, state: str) -> str:
    parts = state.split("_")
    return tier + "".join(p.capitalize() for p in parts) + "NumBlocks"


# (name, type, labels, help): every series this module writes
METRICS: list[tuple[str, str, tuple[str, ...], str]] = [
    *[(f"kvfleet_kv_cache_{_snake(k)}_total", "counter", (), f"cluster cumulative {k} (kvCacheStats, primary tier)")
      for k in KV_STATS_COUNTERS],
    *[(f"kvfleet_kv_cache_{_snake(k[:-len('NumBlocks')])}_blocks", "gauge", (), f"cluster {k} (kvCacheStats)")
      for k in KV_STATS_GAUGES],
    ("kvfleet_kv_cache_tokens_per_block", "gauge", (), "tokens per KV cache block"),
    ("kvfleet_kv_cache_hit_rate", "gauge", (), "cluster cumulative reused / (reused + missed)"),
    *[(f"kvfleet_kv_cache_{_iter_name(f)}_total", "counter", (), f"cluster sum of {f} over emitted records")
      for f in VIEW_COUNTERS[WINDOW_VIEW] if _iter_name(f) not in
      {_snake(k) for k in KV_STATS_COUNTERS}],
    *[(f"kvfleet_kv_cache_window_{_iter_name(f)}_total", "counter", ("window",), f"sum of {f} per window key")
      for f in VIEW_COUNTERS[WINDOW_VIEW]],
    ("kvfleet_kv_cache_window_hit_rate", "gauge", ("window",), "hit rate per window over emitted records"),
    ("kvfleet_kv_cache_window_blocks", "gauge", ("window", "tier", "state"),
     "block gauges per window key from the newest record (peak_* summed over dp groups: an upper bound)"),
    *[(f"kvfleet_kv_cache_pool_group_{_iter_name(f)}_total", "counter", ("pool_group",),
       f"sum of {f} per pool group") for f in VIEW_COUNTERS[POOL_VIEW]],
    ("kvfleet_kv_cache_pool_group_blocks", "gauge", ("pool_group", "tier", "state"),
     "block gauges per pool group from the newest record (peak_* summed: an upper bound)"),
    ("kvfleet_stats_iterations_total", "counter", (), "cluster records emitted (continued over aggregator restarts)"),
    ("kvfleet_stats_incomplete_records_total", "counter", (), "records emitted with missing ranks"),
    ("kvfleet_stats_late_deltas_total", "counter", (), "rank deltas folded into a later record"),
    ("kvfleet_stats_tp_divergences_total", "counter", (), "block fields where a tp rank disagreed with tp rank 0"),
    ("kvfleet_stats_rank_messages_total", "counter", (), "rank deltas merged"),
    ("kvfleet_stats_duplicate_messages_total", "counter", (), "rank deltas of iterations already counted, ignored"),
    ("kvfleet_stats_rejected_messages_total", "counter", (), "malformed rank deltas rejected"),
    ("kvfleet_stats_last_iteration", "gauge", (), "newest emitted iteration"),
    ("kvfleet_requests_running", "gauge", (), "requests running on the ranks (numActiveRequests, newest record)"),
    ("kvfleet_requests_waiting", "gauge", (), "requests queued in the engine (numQueuedRequests, newest record)"),
    ("kvfleet_requests_completed_total", "counter", (), "requests completed (numCompletedRequests summed)"),
    ("kvfleet_iteration_latency_seconds", "gauge", (), "the slowest rank's step (iterLatencyMS, newest record)"),
    ("kvfleet_stats_buffered_records", "gauge", (), "records in the ring buffer"),
    ("kvfleet_stats_subscribers", "gauge", (), "live long-poll subscribers"),
    ("kvfleet_stats_aggregator_epoch", "gauge", (), "aggregator incarnation (1 + restarts)"),
    *[(f"kvfleet_routing_{_snake(k)}_total", "counter", (), f"sum of the records' routing.{k} (this epoch)")
      for k in ROUTING_COUNTERS],
    ("kvfleet_routing_group_requests_total", "counter", ("dp_rank",),
     "requests placed on each dp group (routing.perGroupRequests summed, this epoch)"),
    *[(f"kvfleet_rank_kv_cache_{_snake(k)}_total", "counter", RANK_LABELS, f"rank cumulative {k} (incarnation)")
      for k in KV_STATS_COUNTERS],
    *[(f"kvfleet_rank_kv_cache_{_snake(k[:-len('NumBlocks')])}_blocks", "gauge", RANK_LABELS, f"rank {k}")
      for k in KV_STATS_GAUGES],
    ("kvfleet_rank_kv_cache_hit_rate", "gauge", RANK_LABELS, "rank cumulative hit rate (incarnation)"),
    ("kvfleet_rank_kv_cache_window_blocks", "gauge", RANK_LABELS + ("window", "tier", "state"),
     "rank block gauges per window key from its newest message"),
    ("kvfleet_rank_last_iteration", "gauge", RANK_LABELS, "newest iteration the rank reported"),
    ("kvfleet_rank_last_seen_age_seconds", "gauge", RANK_LABELS, "seconds since the rank's newest message"),
    ("kvfleet_rank_healthy", "gauge", RANK_LABELS, "1 when the rank keeps up with the cluster"),
]


class _Snapshot:
    def __init__(self, snap: dict[str, Any]) -> None:
        self.snap = snap

    def collect(self):
        yield from collect_families(self.snap)
        yield from self.snap.get("vllm") or ()  # vLLM's names (aggregator/vllm_metrics.py)


def _family(name: str, kind: str, helptext: str, labels: tuple[str, ...]):
    if kind == "counter":
        return CounterMetricFamily(name[: -len("_total")], helptext, labels=list(labels))
    return GaugeMetricFamily(name, helptext, labels=list(labels))


def collect_families(snap: dict[str, Any]):
    """Metric families for one aggregator snapshot (StatsAggregatorImpl.metrics_text builds it)."""
    fams = {name: _family(name, kind, h, labels) for name, kind, labels, h in METRICS}

    def put(name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        fams[name].add_metric(list(labels), float(value or 0))

    cluster = snap["cluster"]
    for k in KV_STATS_COUNTERS:
        put(f"kvfleet_kv_cache_{_snake(k)}_total", cluster[k])
    for k in KV_STATS_GAUGES:
        put(f"kvfleet_kv_cache_{_snake(k[:-len('NumBlocks')])}_blocks", cluster[k])
    put("kvfleet_kv_cache_tokens_per_block", cluster["tokensPerBlock"])
    put("kvfleet_kv_cache_hit_rate", cluster["cacheHitRate"])

    windows = snap["totals"][WINDOW_VIEW]
    for f in VIEW_COUNTERS[WINDOW_VIEW]:
        name = f"kvfleet_kv_cache_{_iter_name(f)}_total"
        if name in fams and not fams[name].samples:  # the kvCacheStats counters above take precedence
            put(name, sum(t[f] for t in windows.values()))
    for key, t in windows.items():
        for f in VIEW_COUNTERS[WINDOW_VIEW]:
            put(f"kvfleet_kv_cache_window_{_iter_name(f)}_total", t[f], (key,))
        put("kvfleet_kv_cache_window_hit_rate", hit_rate(t["iterReusedBlocks"], t["iterMissedBlocks"]), (key,))
    for key, t in snap["totals"][POOL_VIEW].items():
        for f in VIEW_COUNTERS[POOL_VIEW]:
            put(f"kvfleet_kv_cache_pool_group_{_iter_name(f)}_total", t[f], (key,))

    latest = snap.get("latest")
    if latest:
        _put_blocks(put, "kvfleet_kv_cache_window_blocks", latest.get(WINDOW_VIEW, {}), ())
        _put_blocks(put, "kvfleet_kv_cache_pool_group_blocks", latest.get(POOL_VIEW, {}), ())

    counts = snap["counts"]
    put("kvfleet_stats_iterations_total", counts["records"])
    put("kvfleet_stats_incomplete_records_total", counts["incomplete"])
    put("kvfleet_stats_late_deltas_total", counts["late_deltas"])
    put("kvfleet_stats_tp_divergences_total", counts["tp_divergences"])
    put("kvfleet_stats_rank_messages_total", counts["deltas"])
    put("kvfleet_stats_duplicate_messages_total", counts["duplicates"])
    put("kvfleet_stats_rejected_messages_total", counts["rejected"])
    put("kvfleet_stats_last_iteration", snap["last_iter"])
    put("kvfleet_requests_completed_total", snap["completed"])
    if latest:
        put("kvfleet_requests_running", latest.get("numActiveRequests", 0))
        put("kvfleet_requests_waiting", latest.get("numQueuedRequests", 0))
        put("kvfleet_iteration_latency_seconds", latest.get("iterLatencyMS", 0) / 1000)
    put("kvfleet_stats_buffered_records", snap["buffered"])
    put("kvfleet_stats_subscribers", snap["subscribers"])
    put("kvfleet_stats_aggregator_epoch", snap["epoch"])
    routing = snap.get("routing") or {}
    for k in ROUTING_COUNTERS:
        put(f"kvfleet_routing_{_snake(k)}_total", routing.get(k, 0))
    for dp, n in (snap.get("routed_per_group") or {}).items():
        put("kvfleet_routing_group_requests_total", n, (dp,))

    for r in snap["ranks"].values():  # aggregator.messages.RankHealth
        lab = (str(r.rank), str(r.dp_rank), str(r.tp_rank))
        put("kvfleet_rank_healthy", 1 if r.healthy else 0, lab)
        rec = r.record
        if rec is None:
            continue
        put("kvfleet_rank_last_iteration", rec["iter"], lab)
        put("kvfleet_rank_last_seen_age_seconds", r.age_s, lab)
        stats = rec.get("kvCacheStats") or {}
        if stats:
            for k in KV_STATS_COUNTERS:
                put(f"kvfleet_rank_kv_cache_{_snake(k)}_total", stats.get(k, 0), lab)
            for k in KV_STATS_GAUGES:
                put(f"kvfleet_rank_kv_cache_{_snake(k[:-len('NumBlocks')])}_blocks", stats.get(k, 0), lab)
            put("kvfleet_rank_kv_cache_hit_rate",
                hit_rate(stats.get("reusedBlocks", 0), stats.get("missedBlocks", 0)), lab)
        _put_blocks(put, "kvfleet_rank_kv_cache_window_blocks", rec.get(WINDOW_VIEW, {}), lab)
    yield from fams.values()


def _put_blocks(put, name: str, buckets: dict[str, dict], lab: tuple[str, ...]) -> None:
    for key, b in buckets.items():
        for tier in ("primary", "secondary"):
            for state in _GAUGE_STATES:
                put(name, b.get(_gauge_field(tier, state), 0), lab + (str(key), tier, state))


def render_metrics(snap: dict[str, Any]) -> str:
    """Prometheus text exposition of one aggregator snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(snap))
    return generate_latest(registry).decode()
