"""vLLM's Prometheus families as kvfleet exports them: names, types, HELP, extra labels and bucket edges.

Copied from vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py), its offloading connector metrics
(the `vllm:kv_offload_*` definitions) and the CPU offloading spec; docs/stats.md says which version and maps
each to kvfleet's data. Every family has the labels `model_name` and `engine` first (docs/http-api.md).
`UNFILLED` is the one list of the series vLLM's Grafana dashboards use that kvfleet cannot have, with why;
docs/stats.md repeats it and the Prometheus e2e test expects exactly those panels' queries to be empty.
"""

from __future__ import annotations

from aggregator.request_stats import FINISH_REASONS, PROMPT_SOURCES
from kvcache.residency import RESIDENCY_BUCKETS

LABELS = ("model_name", "engine")
# vllm:prompt_tokens_cached_by_source's tiers (vLLM PR 56318): kvfleet has the first two
CACHED_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
WAITING_REASONS = ("capacity", "deferred")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
BY_MODEL_LEN = "1-2-5 up to max_model_len"  # a bucket list that build_1_2_5_buckets(max_model_len) makes


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... while <= max_value."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


# name (without _total for counters), type, HELP, extra labels (after model_name, engine), buckets
FAMILIES: list[tuple[str, str, str, tuple[str, ...], object]] = [
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", (), None),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", (), None),
    ("vllm:num_requests_waiting_by_reason", "gauge",
     "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
     "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
     "Sum of all reasons equals vllm:num_requests_waiting.", ("reason",), None),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", (), None),
    ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.", (),
     None),
    ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", (), None),
    ("vllm:external_prefix_cache_queries", "counter",
     "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
     "queried tokens.", (), None),
    ("vllm:external_prefix_cache_hits", "counter",
     "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached "
     "tokens.", (), None),
    ("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.", (), None),
    ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", (), None),
    ("vllm:prompt_tokens_by_source", "counter", "Number of prompt tokens by source.", ("source",), None),
    ("vllm:prompt_tokens_cached", "counter", "Number of cached prompt tokens (local + external).", (), None),
    ("vllm:prompt_tokens_cached_by_source", "counter",
     "Number of cached prompt tokens by the tier that held them, counted at admission.", ("source",), None),
    ("vllm:generation_tokens", "counter", "Number of generation tokens processed.", (), None),
    ("vllm:request_success", "counter", "Count of successfully processed requests.", ("finished_reason",), None),
    ("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed.", (), BY_MODEL_LEN),
    ("vllm:request_generation_tokens", "histogram", "Number of generation tokens processed.", (), BY_MODEL_LEN),
    ("vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.", (),
     ITERATION_TOKENS_BUCKETS),
    ("vllm:request_max_num_generation_tokens", "histogram",
     "Histogram of maximum number of requested generation tokens.", (), BY_MODEL_LEN),
    ("vllm:request_params_n", "histogram", "Histogram of the n request parameter.", (), N_BUCKETS),
    ("vllm:request_params_max_tokens", "histogram", "Histogram of the max_tokens request parameter.", (),
     BY_MODEL_LEN),
    ("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.", (),
     TTFT_BUCKETS),
    ("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.", (),
     ITL_BUCKETS),
    ("vllm:request_time_per_output_token_seconds", "histogram",
     "Histogram of time_per_output_token_seconds per request.", (), ITL_BUCKETS),
    ("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.", (),
     REQUEST_LATENCY_BUCKETS),
    ("vllm:request_queue_time_seconds", "histogram", "Histogram of time spent in WAITING phase for request.", (),
     REQUEST_LATENCY_BUCKETS),
    ("vllm:request_inference_time_seconds", "histogram", "Histogram of time spent in RUNNING phase for request.",
     (), REQUEST_LATENCY_BUCKETS),
    ("vllm:request_prefill_time_seconds", "histogram", "Histogram of time spent in PREFILL phase for request.", (),
     REQUEST_LATENCY_BUCKETS),
    ("vllm:request_decode_time_seconds", "histogram", "Histogram of time spent in DECODE phase for request.", (),
     REQUEST_LATENCY_BUCKETS),
    ("vllm:request_prefill_kv_computed_tokens", "histogram",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", (), BY_MODEL_LEN),
    ("vllm:kv_block_lifetime_seconds", "histogram",
     "Histogram of KV cache block lifetime from allocation to eviction. Every block (kvfleet does not sample).",
     (), RESIDENCY_BUCKETS),
    ("vllm:kv_block_idle_before_evict_seconds", "histogram",
     "Histogram of idle time before KV cache block eviction. Every block (kvfleet does not sample).", (),
     RESIDENCY_BUCKETS),
    ("vllm:kv_block_reuse_gap_seconds", "histogram",
     "Histogram of time gaps between consecutive KV cache block accesses. Every access of every block.", (),
     RESIDENCY_BUCKETS),
    ("vllm:kv_offload_load_bytes", "counter", "Total bytes loaded from offload storage to GPU.", (), None),
    ("vllm:kv_offload_load_time", "counter", "Total load time from offload storage to GPU, in seconds.", (), None),
    ("vllm:kv_offload_load_size", "histogram", "Histogram of KV offload load operation size, in bytes.", (),
     TRANSFER_SIZE_BUCKETS),
    ("vllm:kv_offload_store_bytes", "counter", "Total bytes stored from GPU to offload storage.", (), None),
    ("vllm:kv_offload_store_time", "counter", "Total store time from GPU to offload storage, in seconds.", (),
     None),
    ("vllm:kv_offload_store_size", "histogram", "Histogram of KV offload store operation size, in bytes.", (),
     TRANSFER_SIZE_BUCKETS),
    ("vllm:kv_offload_allocation_failure", "counter",
     "Number of KV offload store allocation attempts that failed.", (), None),
    ("vllm:kv_offload_stores_skipped", "counter", "Number of KV offload stores skipped (below the reuse threshold).",
     (), None),
    ("vllm:kv_offload_cpu_cache_usage_perc", "gauge",
     "Fraction of CPU KV-cache space currently pinned by active transfers (0.0 = idle, 1.0 = saturated).", (),
     None),
    ("vllm:kv_offload_cpu_cache_write_usage_perc", "gauge",
     "Fraction of CPU KV-cache space currently pinned by in-flight stores that have not yet completed.", (), None),
    ("vllm:kv_offload_cpu_cache_read_usage_perc", "gauge",
     "Fraction of CPU KV-cache space currently pinned by in-flight loads that have not yet completed.", (), None),
]
FAMILY = {f[0]: f for f in FAMILIES}
# the label values every engine has from its start (vLLM creates them all up front)
PRESET_LABELS = {"vllm:request_success": FINISH_REASONS, "vllm:prompt_tokens_by_source": PROMPT_SOURCES,
                 "vllm:prompt_tokens_cached_by_source": CACHED_SOURCES,
                 "vllm:num_requests_waiting_by_reason": WAITING_REASONS}

# the series vLLM's KV cache and overview dashboards use that kvfleet cannot have, and why
UNFILLED: dict[str, str] = {
    "vllm:mm_cache_queries_total": "multimodal: kvfleet serves text only, it has no multimodal cache",
    "vllm:mm_cache_hits_total": "multimodal: kvfleet serves text only, it has no multimodal cache",
    "vllm:num_requests_kv_fetch_by_stage": "external KV connectors: kvfleet has no asynchronous KV loads; its "
                                           "host-tier blocks are copied back inside the step that needs them",
    "vllm:kv_offload_lookup_sync_delay_seconds": "external KV connectors: one reuse-tree match finds both tiers' "
                                                 "blocks; there is no separate offload lookup to time",
    "vllm:kv_offload_lookup_async_delay_seconds": "external KV connectors: lookups never defer",
    "vllm:nixl_": "NIXL: kvfleet transfers no KV between instances",
    "vllm:simple_kv_offload_": "SimpleCPUOffloadConnector: an external KV connector kvfleet does not have",
    "http_requests_total": "the API server's HTTP instrumentation: kvfleet's ingress runs several Serve replicas "
                           "behind one /metrics, served from the aggregator; per-replica HTTP counters would "
                           "jump between replicas (Ray Serve exports its own ray_serve_* request metrics)",
    "http_request_duration_seconds": "as http_requests_total",
}


def unfilled_reason(expr: str) -> str | None:
    """Why a dashboard query's series cannot exist in kvfleet (None: it must return data)."""
    for prefix, why in UNFILLED.items():
        if prefix in expr:
            return why
    return None
