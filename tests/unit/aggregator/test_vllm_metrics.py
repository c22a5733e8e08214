"""vLLM's Prometheus names (aggregator/vllm_metrics.py): the renderer, and the real engine's figures over
in-process ranks (no Ray) observed into it."""

import asyncio
import math
import pickle
import random

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from aggregator.metrics import render_metrics
from aggregator.request_stats import FINISH_REASONS, prompt_counts
from aggregator.vllm_metrics import VllmMetrics
from aggregator.vllm_names import FAMILIES, UNFILLED, build_1_2_5_buckets
from kvcache.residency import RESIDENCY_BUCKETS
from tests.support.engine_harness import generate, make_engine, settled
from workers.sampling import SamplingParams

# vLLM's bucket lists, written out again here so a slip in vllm_names.py cannot pass unnoticed
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                         7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:kv_block_lifetime_seconds": [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60,
                                       120, 300, 600, 1200, 1800],
    "vllm:kv_offload_store_size": [1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6],
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200],  # build_1_2_5_buckets(256)
}
MODEL = "kvfleet-test"


class Collector:
    """Stands in for the engine's StatsChannel: keeps every iteration it is given."""

    def __init__(self) -> None:
        self.iterations = []

    def put(self, it) -> None:
        self.iterations.append(it)


async def _traffic(**overrides):
    """The real engine (dp=2, a small primary tier and a host tier) under shared-prefix traffic, aborting one
    request; every iteration it forwarded, and the ranks' layouts."""
    eng = await make_engine(dp=2, served_model_name=MODEL, kv_cache_bytes=160 << 10, host_cache_bytes=512 << 10,
                            **overrides)
    eng.stats = Collector()
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 200) for _ in range(24)] for _ in range(6)]
    prompts = [prefixes[i % 6] + [rng.randrange(1, 200) for _ in range(4)] for i in range(16)]
    await asyncio.gather(*[generate(eng, p, max_tokens=6, ignore_eos=True) for p in prompts])
    stream = eng.generate(None, prefixes[0] + [7], SamplingParams(max_tokens=20, ignore_eos=True))
    await stream.__anext__()
    await stream.aclose()  # the client leaves: an abort
    await settled(eng)
    layouts = {(w.layout.rank, w.layout.incarnation): w.layout for w in eng.rank_workers}
    return eng, eng.stats.iterations, layouts


def _observe(iterations, layouts) -> VllmMetrics:
    v = VllmMetrics("local")
    for it in iterations:
        v.observe(it, layouts)
    return v


def _samples(v: VllmMetrics) -> dict:
    text = render_metrics({"epoch": 1, "counts": dict.fromkeys(
        ("records", "incomplete", "late_deltas", "tp_divergences", "deltas", "duplicates", "rejected"), 0),
        "last_iter": 0, "completed": 0, "buffered": 0, "subscribers": 0, "routing": {}, "routed_per_group": {},
        "cluster": {k: 0 for k in ("allocTotalBlocks", "allocNewBlocks", "reusedBlocks", "missedBlocks",
                                   "maxNumBlocks", "freeNumBlocks", "usedNumBlocks", "tokensPerBlock",
                                   "cacheHitRate")},
        "latest": None, "totals": {"kvCacheIterationStats": {}, "kvCacheIterationStatsByPoolGroup": {}},
        "ranks": {}, "vllm": v.families()})
    return text, {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples: dict, name: str, engine: str | None = None, **labels) -> float:
    """Sum of a sample over the engines (or one), with the other labels given."""
    total = 0.0
    for (n, lab), value in samples.items():
        d = dict(lab)
        if n == name and (engine is None or d["engine"] == engine) and all(d.get(k) == v for k, v in labels.items()):
            total += value
    return total


def test_buckets_are_vllms():
    assert build_1_2_5_buckets(256) == [1, 2, 5, 10, 20, 50, 100, 200]
    assert list(RESIDENCY_BUCKETS) == VLLM_BUCKETS["vllm:kv_block_lifetime_seconds"]
    v = VllmMetrics("e")
    v.model_name, v.max_model_len = MODEL, 256
    v._engine(0)
    fams = {f.name: f for f in v.families()}
    for name, edges in VLLM_BUCKETS.items():
        les = [s.labels["le"] for s in fams[name].samples if s.name.endswith("_bucket")]
        # as prometheus-client writes vLLM's own (1.0, 1e+06)
        assert les == [floatToGoString(e) for e in edges] + ["+Inf"], name


def test_every_family_has_type_help_and_the_two_labels_from_the_start():
    v = VllmMetrics("engine-0")
    assert v.families() == []  # nothing before the engine's first figures (no model name yet)
    v.model_name, v.max_model_len = MODEL, 256
    v._engine(0), v._engine(1)
    text, samples = _samples(v)
    for name, kind, helptext, _extra, _ in FAMILIES:
        shown = f"{name}_total" if kind == "counter" else name  # prometheus-client's text, as vLLM's /metrics
        assert f"# TYPE {shown} {kind}" in text, name
        assert f"# HELP {shown} {helptext}" in text, name
    for (name, labels), _ in samples.items():
        if name.startswith("vllm:"):
            assert dict(labels)["model_name"] == MODEL and dict(labels)["engine"] in {"engine-0/0", "engine-0/1"}
    reasons = {dict(lab)["finished_reason"] for (n, lab) in samples if n == "vllm:request_success_total"}
    assert reasons == set(FINISH_REASONS)  # preset at 0, as vLLM creates them


def test_prompt_counts_follow_vllms_recomputed_token():
    assert prompt_counts(10, 4, 2) == {"total": 10, "cached": 6, "local_compute": 4, "local_cache_hit": 4,
                                       "external_kv_transfer": 2}
    full = prompt_counts(17, 16, 0)  # all but the last token cached: vLLM books that token twice
    assert full["local_compute"] == 1 and full["local_cache_hit"] == 17 and full["cached"] == 16


def test_engine_figures_fill_the_families_and_agree_with_each_other():
    eng, iterations, layouts = asyncio.run(_traffic())
    v = _observe(iterations, layouts)
    _, s = _samples(v)
    finished = _value(s, "vllm:request_success_total")
    assert finished == 17 and _value(s, "vllm:request_success_total", finished_reason="abort") == 1
    assert _value(s, "vllm:request_success_total", finished_reason="length") == 16
    assert _value(s, "vllm:e2e_request_latency_seconds_count") == finished
    assert _value(s, "vllm:time_to_first_token_seconds_count") == 17  # the aborted one had its first token
    generated = _value(s, "vllm:generation_tokens_total")
    assert generated >= 16 * 6 + 1
    # one inter-token latency per token after the first, as vLLM
    assert _value(s, "vllm:inter_token_latency_seconds_count") == generated - 17
    assert _value(s, "vllm:request_generation_tokens_sum") == generated
    prompt = _value(s, "vllm:prompt_tokens_total")
    assert prompt == 16 * 28 + 25 == _value(s, "vllm:request_prompt_tokens_sum")
    by_source = {src: _value(s, "vllm:prompt_tokens_by_source_total", source=src)
                 for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    cached = _value(s, "vllm:prompt_tokens_cached_total")
    assert 0 < cached < prompt and by_source["local_compute"] == prompt - cached
    assert by_source["local_cache_hit"] + by_source["external_kv_transfer"] >= cached
    assert _value(s, "vllm:request_prefill_kv_computed_tokens_sum") == prompt - cached
    hits, queries = _value(s, "vllm:prefix_cache_hits_total"), _value(s, "vllm:prefix_cache_queries_total")
    assert queries == prompt and 0 < hits < queries  # tokens, looked up once per request as vLLM
    assert _value(s, "vllm:prompt_tokens_cached_by_source_total", source="device") == hits
    assert _value(s, "vllm:prompt_tokens_cached_by_source_total", source="host") == \
        _value(s, "vllm:external_prefix_cache_hits_total")
    assert _value(s, "vllm:external_prefix_cache_queries_total") == queries - hits
    assert _value(s, "vllm:iteration_tokens_total_sum") == prompt + generated
    for phase in ("queue", "prefill", "decode", "inference"):
        assert _value(s, f"vllm:request_{phase}_time_seconds_count") == 17, phase
    # both dp groups served, and each has its own series
    assert all(_value(s, "vllm:request_success_total", engine=f"local/{dp}") > 0 for dp in (0, 1))
    assert _value(s, "vllm:num_requests_running") == 0 and _value(s, "vllm:num_requests_waiting") == 0
    # the small primary tier evicted to the host tier: bytes, times, sizes and residency of every block
    stored = _value(s, "vllm:kv_offload_store_bytes_total")
    assert stored > 0 and _value(s, "vllm:kv_offload_store_size_sum") == stored
    assert _value(s, "vllm:kv_offload_store_time_total") > 0
    evicted = _value(s, "vllm:kv_block_lifetime_seconds_count")
    assert evicted > 0 and _value(s, "vllm:kv_block_idle_before_evict_seconds_count") == evicted
    assert _value(s, "vllm:kv_block_reuse_gap_seconds_count") > 0
    assert 0 <= _value(s, "vllm:kv_cache_usage_perc") <= 2
    eng.close = None


def test_counters_never_go_backwards_over_a_restore():
    _, iterations, layouts = asyncio.run(_traffic())
    half = len(iterations) // 2
    first = _observe(iterations[:half], layouts)
    _, before = _samples(first)
    restored = VllmMetrics("local")
    restored.restore(pickle.loads(pickle.dumps(first.to_state())))  # what the aggregator checkpoint holds
    assert _samples(restored)[1] == before
    for it in iterations[half:]:
        restored.observe(it, layouts)
    _, after = _samples(restored)
    whole = _samples(_observe(iterations, layouts))[1]
    for key, value in before.items():
        name = key[0]
        if name.endswith(("_total", "_count", "_sum", "_bucket")):
            assert after[key] >= value, key
            assert math.isclose(after[key], whole[key], rel_tol=1e-9, abs_tol=1e-9), key


def test_unfilled_names_only_what_kvfleet_cannot_have():
    exported = {name for name, *_ in FAMILIES}
    assert not any(name.startswith(prefix) for name in exported for prefix in UNFILLED)
    assert all(why for why in UNFILLED.values())
