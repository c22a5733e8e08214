"""TensorRT-LLM's own readers on our records: a real record from the in-process engine through the Assembler.

tensorrt_llm is not installable here, so the reading code is reproduced as it is in NVIDIA/TensorRT-LLM,
tensorrt_llm/metrics/collector.py (MetricsCollector._log_cached_tokens_by_level and _cache_level_labels, called
from log_iteration_stats with `iteration_stats.get("iterCachedTokensByLevel")` and
`iteration_stats.get("kvCacheLevelTiers")`); only the Prometheus counter is replaced by a dict.
"""

import asyncio
import json

from aggregator.assembler import Assembler
from tests.support.engine_harness import generate, make_engine


def log_cached_tokens_by_level(counter: dict, counts, level_tiers) -> None:
    """collector.py's _log_cached_tokens_by_level, with `counter` standing in for the Prometheus counter."""
    if not counts:
        return
    for level, count in enumerate(counts):
        if count > 0:
            tier = level_tiers[level] if level_tiers and level < len(level_tiers) else ""
            key = (str(level), tier)
            counter[key] = counter.get(key, 0) + count


class RecordingChannel:
    """The engine's stats channel straight into an Assembler (no aggregator actor)."""

    def __init__(self, asm: Assembler) -> None:
        self.asm, self.records = asm, []

    def put(self, it) -> None:
        self.records += self.asm.ingest([it])

    async def register(self, layouts) -> None:
        self.asm.register(layouts)

    async def drained(self) -> None:
        pass

    async def close(self) -> None:
        pass


async def _records() -> list[dict]:
    """A prompt, others until its blocks were offloaded to the host tier, then the prompt again."""
    eng = await make_engine(kv_cache_bytes=256 << 10, host_cache_bytes=1 << 20)
    asm = Assembler("local", 1, 1)
    asm.register([w.layout for w in eng.rank_workers])
    eng.stats = RecordingChannel(asm)
    prompt = list(range(1, 66))
    await generate(eng, prompt, max_tokens=2, temperature=0.0)
    for k in range(6):
        await generate(eng, [(7 * k + 3 * i) % 250 + 1 for i in range(65)], max_tokens=2, temperature=0.0)
    await generate(eng, prompt, max_tokens=2, temperature=0.0)
    await eng.shutdown()
    return [json.loads(json.dumps(r)) for r in eng.stats.records]


def test_trtllm_collector_reads_cached_tokens_by_level_with_host_hits_in_their_own_level():
    records = asyncio.run(_records())
    counter: dict = {}
    for rec in records:
        log_cached_tokens_by_level(counter, rec["iterCachedTokensByLevel"], rec["kvCacheLevelTiers"])
        assert rec["kvCacheLevelTiers"] == ["gpu", "host"]
        assert isinstance(rec["iterCachedTokensByLevel"], list) and len(rec["iterCachedTokensByLevel"]) == 2
    # the repeated prompt's 64 reusable tokens were all on the host tier when it came back
    assert counter.get(("1", "host"), 0) >= 64
    assert sum(counter.values()) == sum(sum(r["iterCachedTokensByLevel"]) for r in records)


# the top-level fields TensorRT-LLM's own /metrics test asserts in a record
# (tests/unittest/llmapi/apps/_test_openai_metrics.py in NVIDIA/TensorRT-LLM)
TRT_TOP = ["cpuMemUsage", "gpuMemUsage", "inflightBatchingStats", "iter", "iterLatencyMS", "kvCacheStats",
           "maxBatchSizeRuntime", "maxBatchSizeStatic", "maxBatchSizeTunerRecommended", "maxNumActiveRequests",
           "maxNumTokensRuntime", "maxNumTokensStatic", "maxNumTokensTunerRecommended",
           "newActiveRequestsQueueLatencyMS", "numActiveRequests", "numCompletedRequests", "numNewActiveRequests",
           "numQueuedRequests", "pinnedMemUsage", "staticBatchingStats", "timestamp", "kvCacheIterationStats"]


def test_a_record_has_trtllm_serves_fields_with_its_types_and_real_values():
    records = asyncio.run(_records())
    for rec in records:
        assert [k for k in TRT_TOP if k not in rec] == []
        # make_engine: one dp group of max_num_seqs (Settings' default) and max_num_batched_tokens 48
        assert rec["maxBatchSizeStatic"] == rec["maxBatchSizeRuntime"] == rec["maxNumActiveRequests"] > 0
        assert rec["maxNumTokensStatic"] == rec["maxNumTokensRuntime"] == 48
        assert rec["maxBatchSizeTunerRecommended"] == rec["maxNumTokensTunerRecommended"] == 0  # no tuner
        assert set(rec["staticBatchingStats"]) == {"numScheduledRequests", "numContextRequests", "numCtxTokens",
                                                   "numGenTokens", "emptyGenSlots"}
        assert isinstance(rec["newActiveRequestsQueueLatencyMS"], float)
        assert (rec["newActiveRequestsQueueLatencyMS"] > 0) == (rec["numNewActiveRequests"] > 0)
        for bucket in rec["kvCacheIterationStatsByPoolGroup"].values():
            assert isinstance(bucket["slotSize"], list) and all(isinstance(b, int) for b in bucket["slotSize"])
    assert any(r["numNewActiveRequests"] for r in records)
