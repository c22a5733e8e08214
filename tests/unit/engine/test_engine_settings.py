"""Each engine setting a user may change still serves the same greedy tokens (in-process ranks, no Ray).

A setting off the default path is where a start-up or step bug hides: `enable_stats=false` failed every rank
at set-up until a test of it existed."""

import asyncio

import pytest

from tests.support.engine_harness import generate, make_engine, settled

PROMPT = list(range(1, 40))
CHANGED = [
    {"enable_block_reuse": False}, {"enable_partial_reuse": False}, {"host_cache_bytes": 256 << 10},
    {"host_cache_bytes": -1}, {"tokens_per_block": 1}, {"tokens_per_block": 64}, {"max_num_seqs": 1},
    {"max_num_batched_tokens": 1}, {"enable_stats": False, "dp": 2}, {"kv_events": True},
    {"routing": "kv", "dp": 2}, {"routing": "least_loaded", "dp": 2}, {"routing": "round_robin", "dp": 2},
]


@pytest.mark.parametrize("changed", CHANGED, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_a_changed_setting_serves_the_default_tokens(changed):
    async def main():
        want = await generate(await make_engine(), PROMPT, max_tokens=6, temperature=0.0)
        eng = await make_engine(**changed)
        together = await asyncio.gather(*[generate(eng, PROMPT, max_tokens=6, temperature=0.0) for _ in range(3)])
        assert together == [want] * 3
        assert await generate(eng, PROMPT, max_tokens=6, temperature=0.0) == want  # again, reusing what it cached
        await settled(eng)
        assert all(w.kv.get_kv_cache_stats().used_num_blocks == 0 for w in eng.rank_workers)

    asyncio.run(main())
