"""TensorRT-LLM's own readers on our records: a real record from the in-process engine through the Assembler.

tensorrt_llm is not installable here, so the reading code is reproduced as it is in NVIDIA/TensorRT-LLM,
tensorrt_llm/metrics/collector.py (MetricsCollector._log_cached_tokens_by_level and _cache_level_labels, called
from log_iteration_stats with `iteration_stats.get("iterCachedTokensByLevel")` and
`iteration_stats.get("kvCacheLevelTiers")`); only the Prometheus counter is replaced by a dict.
"""

import asyncio
import json

from aggregator.assembler import Assembler
from tests.engine_harness import generate, make_engine


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
