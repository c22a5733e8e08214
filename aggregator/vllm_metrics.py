"""vLLM's Prometheus families (aggregator/vllm_names.py) from the iterations the aggregator emits.

One `engine` label value per dp group, `<engine_id>/<dp>`: a dp group is what vLLM calls a DP engine.
Sources, per iteration: the ranks' rows (KV cache and host-tier gauges from tp rank 0; bytes moved and copy
times from every tp rank, as vLLM sums its workers' connector stats), the ranks' block residency counts (tp
rank 0: its tp peers make the same block decisions), and the engine's request figures (queues, tokens,
prefix lookups, request times). Everything is cumulative in this object and checkpointed with the
aggregator's state, so a restarted aggregator goes on where its checkpoint was: counters never go backwards.
Cost: O(ranks + requests finished + tokens delivered) per iteration, never O(blocks held).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from aggregator.delta import KV_STATS_INDEX, Iteration, RankLayout
from aggregator.request_stats import FinishedRequest, RequestFigures
from aggregator.vllm_names import BY_MODEL_LEN, FAMILIES, FAMILY, PRESET_LABELS, build_1_2_5_buckets
from kvcache.residency import RESIDENCY_KINDS
from kvcache.stats import OFFLOAD_BYTES, ONBOARD_BYTES

_MAX, _USED = KV_STATS_INDEX["maxNumBlocks"], KV_STATS_INDEX["usedNumBlocks"]
_HOST_MAX, _HOST_USED = 7, 9  # a pool group's secondary-tier gauges in the row (NUM_GAUGES order)
_RESIDENCY = [f"vllm:kv_block_{kind}_seconds" for kind in RESIDENCY_KINDS]
# a finished request's figure -> the histogram it goes into
_FINISHED = {"prompt_tokens": ["vllm:request_prompt_tokens"],
             "generation_tokens": ["vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens"],
             "max_tokens": ["vllm:request_params_max_tokens"],
             "computed_tokens": ["vllm:request_prefill_kv_computed_tokens"],
             "e2e_s": ["vllm:e2e_request_latency_seconds"], "queue_s": ["vllm:request_queue_time_seconds"],
             "prefill_s": ["vllm:request_prefill_time_seconds"], "decode_s": ["vllm:request_decode_time_seconds"],
             "inference_s": ["vllm:request_inference_time_seconds"],
             "tpot_s": ["vllm:request_time_per_output_token_seconds"]}


class Hist:
    """A histogram's counts per bucket (then +Inf), not cumulative, and its sum."""

    __slots__ = ("edges", "counts", "sum")

    def __init__(self, edges, counts: list[int] | None = None, total: float = 0.0) -> None:
        self.edges = tuple(float(e) for e in edges)
        self.counts = counts or [0] * (len(self.edges) + 1)
        self.sum = total

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.edges, value)] += 1  # le is inclusive, as prometheus-client's
        self.sum += value

    def add(self, counts, total: float) -> None:
        for i, c in enumerate(counts):
            self.counts[i] += c
        self.sum += total

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for edge, c in zip(self.edges + (float("inf"),), self.counts, strict=True):
            acc += c
            out.append((floatToGoString(edge), acc))
        return out


class GroupSeries:
    """One dp group's cumulative counters, latest gauges and histograms, keyed (family, extra label values)."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self.gauges: dict[tuple[str, tuple[str, ...]], float] = {}
        self.hists: dict[str, Hist] = {}
        self.host = False  # has a host tier

    def inc(self, name: str, value: float, *labels: str) -> None:
        key = (name, labels)
        self.counters[key] = self.counters.get(key, 0) + value

    def set(self, name: str, value: float, *labels: str) -> None:
        self.gauges[(name, labels)] = float(value)


class VllmMetrics:
    """The vLLM families of one engine: `observe` each emitted iteration, `families` at scrape time."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.model_name: str | None = None
        self.max_model_len = 0
        self.engines: dict[int, GroupSeries] = {}

    # ---- state ---------------------------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """A copy (`observe` changes the dicts and lists in place): the checkpoint's, and what a failed save
        rolls back to. O(series)."""
        return {"model_name": self.model_name, "max_model_len": self.max_model_len,
                "engines": {dp: {"c": dict(e.counters), "g": dict(e.gauges), "host": e.host,
                                 "h": {n: (h.edges, list(h.counts), h.sum) for n, h in e.hists.items()}}
                            for dp, e in self.engines.items()}}

    def restore(self, state: dict[str, Any] | None) -> None:
        """Back to a `to_state()` (none: as new)."""
        self.engines = {}
        if not state:
            return
        self.model_name, self.max_model_len = state["model_name"], state["max_model_len"]
        for dp, s in state["engines"].items():
            e = self._engine(dp)
            e.counters, e.gauges, e.host = dict(s["c"]), dict(s["g"]), s["host"]
            e.hists = {n: Hist(edges, list(counts), total) for n, (edges, counts, total) in s["h"].items()}

    # ---- observing -----------------------------------------------------------------------------------------
    def _engine(self, dp: int) -> GroupSeries:
        e = self.engines.get(dp)
        if e is None:
            e = self.engines[dp] = GroupSeries()
        return e

    def _hist(self, e: GroupSeries, name: str) -> Hist:
        h = e.hists.get(name)
        if h is None:
            buckets = FAMILY[name][4]
            h = e.hists[name] = Hist(build_1_2_5_buckets(self.max_model_len) if buckets == BY_MODEL_LEN else buckets)
        return h

    def observe(self, it: Iteration, layouts: dict[tuple[int, str], RankLayout]) -> None:
        """Add one emitted iteration (its deltas already checked by the assembler)."""
        if it.requests is not None:
            self.model_name, self.max_model_len = it.requests.model_name, it.requests.max_model_len
        for d in it.deltas:
            lay = layouts.get((getattr(d, "rank", None), getattr(d, "incarnation", None)))
            if lay is not None and isinstance(d.row, np.ndarray) and d.row.shape == (lay.row_size,):
                self._rank(lay, d)
        if it.requests is not None:
            self._requests(it.requests)

    def _rank(self, lay: RankLayout, d: Any) -> None:
        e = self._engine(lay.dp_rank)
        counters, gauges, kv, _ = lay.parts(d.row)
        blocks = d.blocks
        for direction, col, seconds in (("load", ONBOARD_BYTES, blocks.onboard_s if blocks else 0.0),
                                        ("store", OFFLOAD_BYTES, blocks.offload_s if blocks else 0.0)):
            nbytes = int(counters[:, col].sum())
            e.inc(f"vllm:kv_offload_{direction}_time", seconds)
            if nbytes:  # one operation: what this rank moved that way in the step
                e.inc(f"vllm:kv_offload_{direction}_bytes", nbytes)
                self._hist(e, f"vllm:kv_offload_{direction}_size").observe(nbytes)
        if lay.tp_rank:
            return
        e.set("vllm:kv_cache_usage_perc", kv[_USED] / kv[_MAX] if kv[_MAX] else 0.0)
        host_max, host_used = int(gauges[:, _HOST_MAX].sum()), int(gauges[:, _HOST_USED].sum())
        e.host = host_max > 0
        usage = host_used / host_max if host_max else 0.0  # pinned: held by suspended requests, not evictable
        e.set("vllm:kv_offload_cpu_cache_usage_perc", usage)
        e.set("vllm:kv_offload_cpu_cache_write_usage_perc", 0.0)  # copies finish inside the step
        e.set("vllm:kv_offload_cpu_cache_read_usage_perc", usage)  # vLLM's: usage - write usage
        if blocks is not None:
            for name, counts, total in zip(_RESIDENCY, blocks.counts, blocks.sums, strict=True):
                self._hist(e, name).add(counts, total)

    def _requests(self, r: RequestFigures) -> None:
        for dp in range(len(r.running)):
            e = self._engine(dp)
            e.set("vllm:num_requests_running", r.running[dp])
            e.set("vllm:num_requests_waiting", r.waiting[dp])
            e.set("vllm:num_requests_waiting_by_reason", r.waiting[dp], "capacity")  # room: seqs or KV blocks
            e.set("vllm:num_requests_waiting_by_reason", 0, "deferred")
            e.inc("vllm:num_preemptions", r.preempted[dp])
            e.inc("vllm:generation_tokens", r.generated[dp])
            e.inc("vllm:prefix_cache_queries", r.queries[dp])
            e.inc("vllm:prefix_cache_hits", r.local_hits[dp])
            if e.host:  # the host tier is asked for what the primary tier did not have
                e.inc("vllm:external_prefix_cache_queries", r.queries[dp] - r.local_hits[dp])
                e.inc("vllm:external_prefix_cache_hits", r.host_hits[dp])
            e.inc("vllm:prompt_tokens_cached_by_source", r.local_hits[dp], "device")
            e.inc("vllm:prompt_tokens_cached_by_source", r.host_hits[dp], "host")
            p = r.prompt[dp]
            e.inc("vllm:prompt_tokens", p["total"])
            e.inc("vllm:prompt_tokens_cached", p["cached"])
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
                e.inc("vllm:prompt_tokens_by_source", p[source], source)
            if r.step_tokens[dp] >= 0:
                self._hist(e, "vllm:iteration_tokens_total").observe(r.step_tokens[dp])
        for dp, seconds in r.ttft:
            self._hist(self._engine(dp), "vllm:time_to_first_token_seconds").observe(seconds)
        for dp, seconds in r.itl:
            self._hist(self._engine(dp), "vllm:inter_token_latency_seconds").observe(seconds)
        for f in r.finished:
            self._finished(f)

    def _finished(self, f: FinishedRequest) -> None:
        e = self._engine(f.dp)
        e.inc("vllm:request_success", 1, f.reason)
        self._hist(e, "vllm:request_params_n").observe(1)
        for attr, names in _FINISHED.items():
            value = getattr(f, attr)
            if value is not None:
                for name in names:
                    self._hist(e, name).observe(value)

    # ---- rendering -----------------------------------------------------------------------------------------
    def families(self) -> list:
        """Every family, every engine's series (none before the engine's first request figures)."""
        if self.model_name is None:
            return []
        out = []
        for name, kind, helptext, extra, _ in FAMILIES:
            labels = ["model_name", "engine", *extra]
            if kind == "counter":
                fam = CounterMetricFamily(name, helptext, labels=labels)
            elif kind == "gauge":
                fam = GaugeMetricFamily(name, helptext, labels=labels)
            else:
                fam = HistogramMetricFamily(name, helptext, labels=labels)
            for dp in sorted(self.engines):
                self._put(fam, kind, name, extra, dp)
            out.append(fam)
        return out

    def _put(self, fam, kind: str, name: str, extra: tuple[str, ...], dp: int) -> None:
        e, base = self.engines[dp], [self.model_name, f"{self.engine_id}/{dp}"]
        if kind == "histogram":
            h = self._hist(e, name)
            fam.add_metric(base, h.buckets(), h.sum)
            return
        values = e.counters if kind == "counter" else e.gauges
        keys = [(v,) for v in PRESET_LABELS.get(name, ())] if extra else [()]
        for key in keys:
            fam.add_metric(base + list(key), values.get((name, key), 0.0))
