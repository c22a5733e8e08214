"""Placement over in-process ranks (no Ray): kv routing follows the prefix, the index follows the ranks."""

import asyncio

import pytest

from engine.errors import RequestFailed
from engine.kv_stream import vllm_events
from kvcache.events import REMOVED, KVEvent, key_of, prompt_keys
from tests.support.engine_harness import generate, make_engine, settled
from tests.support.kvcache_helpers import tree_blocks
from workers.sampling_params import SamplingParams

B = 16
TENANT_A = list(range(1, 97))  # 6 full blocks
TENANT_B = list(range(101, 197))


def run(coro):
    return asyncio.run(coro)


async def ask(eng, prompt, salt=None, max_tokens=3):
    return [ev.token_id async for ev in eng.generate(None, prompt, SamplingParams(max_tokens=max_tokens,
                                                                                  temperature=0.0), salt)]


async def served(eng, prompt, salt=None):
    """Ask, then let the engine close what finished (its blocks are published and the index has them)."""
    await ask(eng, prompt, salt)
    await settled(eng)


def routed_engine(**overrides):
    return make_engine(**{"kv_cache_bytes": 2 << 20, "max_seq_len": 256, **overrides})


def placed(eng, prompt, salt=None):
    up = [dp for dp, g in enumerate(eng._groups) if g.down is None]
    keys = eng.hub.keys(prompt, salt)
    return eng.placement.choose(keys, len(prompt), eng._groups, up)


def test_kv_routing_follows_the_prefix_and_predicted_equals_realized():
    async def main():
        eng = await routed_engine(dp=2)
        await served(eng, TENANT_A + [200])
        await served(eng, TENANT_B + [200])
        a_group = eng.hub.index.prefix(0, prompt_keys(TENANT_A, B)) != (0, 0)
        held_a = 0 if a_group else 1
        assert eng.hub.index.prefix(held_a, prompt_keys(TENANT_A, B)) == (6, 0)
        assert eng.hub.index.prefix(1 - held_a, prompt_keys(TENANT_B, B)) == (6, 0)  # B went to the other
        first = eng.routing_record.take()
        assert first["requests"] == 2 and first["predictedReusedBlocks"] == first["realizedReusedBlocks"] == 0
        for i in range(3):
            dp, predicted = placed(eng, TENANT_A + [210 + i])
            assert dp == held_a and predicted == eng.placement.reuse_table[6] > 0
            await served(eng, TENANT_A + [210 + i])
            dp, _ = placed(eng, TENANT_B + [210 + i])
            assert dp == 1 - held_a
            await served(eng, TENANT_B + [210 + i])
        rec = eng.routing_record.take()
        assert rec["requests"] == 6 and rec["perGroupRequests"] == [3, 3]
        assert rec["predictedReusedBlocks"] == rec["realizedReusedBlocks"] == 6 * eng.placement.reuse_table[6]
        for dp in range(2):  # the index is exactly what each group's rank holds
            assert eng.hub.index.blocks[dp] == tree_blocks(eng.rank_workers[dp].kv)
        assert eng.hub.index.errors == 0

    run(main())


def test_a_hot_tenant_does_not_pile_onto_one_group():
    async def main():
        eng = await routed_engine(dp=2)
        await served(eng, TENANT_A + [200])
        held_a = 0 if eng.hub.index.prefix(0, prompt_keys(TENANT_A, B)) != (0, 0) else 1
        hot = [asyncio.ensure_future(ask(eng, TENANT_A + [230 + i], max_tokens=32)) for i in range(8)]
        await asyncio.gather(*hot)
        await settled(eng)
        per_group = eng.routing_record.take()["perGroupRequests"]
        assert per_group[held_a] > per_group[1 - held_a] - 1 >= 0  # the holder gets most, the other is used too
        assert all(n > 0 for n in per_group)

    run(main())


def test_salts_are_isolated_in_the_placement():
    async def main():
        eng = await routed_engine(dp=2)
        await served(eng, TENANT_A + [200], salt="t1")
        _, predicted = placed(eng, TENANT_A + [201], salt="t2")
        assert predicted == 0  # the same tokens under another salt predict nothing
        _, predicted = placed(eng, TENANT_A + [201], salt="t1")
        assert predicted > 0
        await ask(eng, TENANT_A + [201], salt="t2")
        rec = eng.routing_record.take()
        assert sum(s["requests"] for s in rec["perSalt"].values()) == rec["requests"] == 2
        assert rec["realizedReusedBlocks"] == 0  # t2 reused nothing of t1's

    run(main())


def test_bad_events_resync_the_group_from_a_snapshot():
    async def main():
        eng = await routed_engine(dp=1)
        await served(eng, TENANT_A + [200])
        assert not eng.hub.index.apply(0, [KVEvent(REMOVED, key=12345)])  # an unknown block removed
        assert eng.hub.index.errors == 1 and eng.hub.index.blocks[0] == {}
        await served(eng, TENANT_B + [200])  # the next step asks the rank for a snapshot
        assert eng.hub.index.blocks[0] == tree_blocks(eng.rank_workers[0].kv) != {}
        assert eng.hub.index.prefix(0, prompt_keys(TENANT_A, B)) == (6, 0)

    run(main())


def fold(view: list[dict], events: list) -> None:
    """What a /kv_events client holds per dp group (key -> medium) after applying `events`."""
    for _, ev in events:
        held = view[ev["dp_rank"]]
        if ev["type"] == "AllBlocksCleared":
            held.clear()
        for key in ev.get("block_hashes", ()):
            if ev["type"] == "BlockStored":
                held[key] = ev["medium"]
            elif held.get(key) == ev["medium"]:
                del held[key]


def test_a_step_that_raises_on_a_live_rank_resyncs_the_index_and_the_stream():
    """The ranks' caches changed in the step that raised, and that step's events never arrived: the group
    resyncs from a snapshot instead of drifting from what the rank holds."""
    async def main():
        eng = await routed_engine(dp=1)
        stream = eng.hub.stream
        await served(eng, TENANT_B + [200])  # the index is in step with the rank (its first snapshot is in)
        assert not eng.hub.index.resync[0]
        got = vllm_events(stream.since(None), B)  # a /kv_events client follows the stream
        view = [{}]
        fold(view, got)
        worker = eng.rank_workers[0]
        real, raised = worker.step, []

        def step(plan):
            res = real(plan)
            if not raised and plan.work:  # the first prefill step of the request below stores blocks
                raised.append(plan.iteration)
                raise RuntimeError("the step raised after storing blocks")
            return res

        worker.step = step
        with pytest.raises(RequestFailed):
            await ask(eng, TENANT_A + [200])
        await served(eng, TENANT_B + [201])
        assert raised
        held = tree_blocks(worker.kv)
        assert eng.hub.index.prefix(0, prompt_keys(TENANT_A, B))[0] > 0  # the failed step's blocks, too
        assert eng.hub.index.blocks[0] == held
        fold(view, vllm_events(stream.since(got[-1][0]), B))
        assert view[0] == {k: ("GPU", "CPU")[t] for k, t in held.items()}

    run(main())


def salted_keys(mgr, salt) -> set[int]:
    """The key of every block the manager's reuse tree holds under `salt`."""
    stack, keys = list(mgr.reuse.roots[(type(salt), salt)].children.values()), set()
    while stack:
        node = stack.pop()
        keys.add(key_of(node))
        stack.extend(node.children.values())
    return keys


def test_a_salted_prompt_never_leaves_the_engine_on_kv_events():
    async def main():
        eng = await routed_engine(dp=1)
        stream = eng.hub.stream
        stream.since(None)  # a /kv_events client listens: every event is kept in the replay buffer
        await ask(eng, TENANT_A + [200], salt="tenant-a")
        await served(eng, TENANT_B + [200])
        eng.hub.drop_group(0)  # the next step publishes the rank's snapshot of every block it holds
        await served(eng, TENANT_B + [201])
        mine = salted_keys(eng.rank_workers[0].kv, "tenant-a")
        events = [ev for _, ev in vllm_events([*stream.buffer, *stream.since(None)], B)]  # live + snapshots
        stored = [ev for ev in events if ev["type"] == "BlockStored"]
        salted = [ev for ev in stored if set(ev["block_hashes"]) & mine]
        assert len(salted) > len(mine)  # every salted block, live and in both snapshots, by its hash
        assert all(ev["token_ids"] == [] for ev in salted), "a salted prompt's tokens reached /kv_events"
        assert any(ev["token_ids"] == TENANT_B[:B] for ev in stored)  # unsalted blocks still carry theirs

    run(main())


def test_events_are_off_and_free_when_routing_is_not_kv_and_nobody_listens():
    async def main():
        seen = []
        eng = await make_engine(dp=2, routing="least_loaded")
        real = eng.rank_workers[0].step

        def step(plan):
            res = real(plan)
            seen.append((plan.kv_events, res.kv_events, eng.rank_workers[0].kv.kv_events))
            return res

        eng.rank_workers[0].step = step
        await generate(eng, TENANT_A[:40], max_tokens=3, temperature=0.0)
        await settled(eng)
        assert seen and all(s == (False, None, None) for s in seen)
        assert eng.hub.keys(TENANT_A, None) is None  # no prompt is hashed either
        rec = eng.routing_record.take()
        assert rec["policy"] == "least_loaded" and rec["requests"] == 1 and rec["predictedReusedBlocks"] == 0

    run(main())


def test_round_robin_cycles_over_the_groups():
    async def main():
        eng = await make_engine(dp=2, routing="round_robin")
        assert [placed(eng, TENANT_A)[0] for _ in range(4)] == [0, 1, 0, 1]

    run(main())


def test_the_prediction_counts_the_block_a_rank_reuses_in_part():
    """Partial reuse: a prompt that runs past its held full blocks into part of a block the group holds (here
    the trailing partial block an earlier request published) is predicted to reuse it too, so predicted equals
    realized; a prompt whose next tokens match no held block predicts full blocks only."""
    async def main():
        eng = await routed_engine(dp=1)
        worth = eng.placement.partial_worth  # one block per life cycle
        assert worth >= 1
        out = await ask(eng, TENANT_A + [200], max_tokens=4)
        await settled(eng)
        eng.routing_record.take()
        tail = [200] + out[:2]  # the start of the published partial block after the 6 full ones
        for prompt in (TENANT_A + tail + [7, 8], TENANT_A + [201, 7, 8], TENANT_A + tail[:1] + [9, 9, 9]):
            await served(eng, prompt)
        rec = eng.routing_record.take()
        full = eng.placement.reuse_table[6]
        assert rec["requests"] == 3 and rec["predictedReusedBlocks"] == rec["realizedReusedBlocks"]
        assert rec["predictedReusedBlocks"] == 3 * full + 2 * worth  # the first and third reuse part of the tail

    run(main())


def test_requests_that_arrive_together_share_a_prefix_the_first_one_computes():
    """The scheduler admits a waiting request only while the step's token budget lasts (as vLLM's): one that
    arrives with another of the same prefix is created on the rank once that prefix's blocks are published, and
    reuses them, rather than prefilling the same prefix beside it (all three were created at once before)."""
    async def main():
        eng = await routed_engine(dp=1)  # max_num_batched_tokens 48: a 97-token prompt takes three steps
        await asyncio.gather(*[ask(eng, TENANT_A + [210 + i]) for i in range(3)])
        await settled(eng)
        rec = eng.routing_record.take()
        assert rec["requests"] == 3
        assert rec["realizedReusedBlocks"] == 2 * eng.placement.reuse_table[6] > 0  # all but the first

    run(main())
