"""Placement scoring, the routing record's sums, and the KV event stream (pure: no ranks, no Ray)."""

import types

from aggregator.assembler import Assembler
from aggregator.delta import Iteration
from aggregator.metrics import render_metrics
from deployment.settings import Settings
from engine.kv_hub import KVEventHub
from engine.kv_index import KVIndex
from engine.kv_stream import KVEventStream, vllm_events
from engine.placement import Placement, group_load
from engine.routing_record import TOP_SALTS, RoutingRecord, salt_label
from engine.scheduler import Group, Request
from kvcache.events import CLEARED, MOVED, REMOVED, STORED, KVEvent, block_key, prompt_keys
from workers.sampling_params import SamplingParams

B = 16
PROMPT = list(range(1, 65))  # 4 full blocks


def placement(**kw) -> Placement:
    s = Settings(model="random", dp=3, **kw)
    c = s.engine_config()
    hub = KVEventHub(c.kv_events, c.routing.policy == "kv", s.tokens_per_block, 3)
    hub.recording = True
    hub.index.resync = [False] * 3
    hub.free = [100, 100, 100]
    return Placement(c.routing, hub)


def busy(tokens: int) -> Group:
    g = Group()
    if tokens:
        g.waiting.append(Request("x", [1] * tokens, SamplingParams(max_tokens=1), None, 1))
    return g


def hold(r: Placement, dp: int, keys: list[int], tier: int = 0) -> None:
    r.hub.index.apply(dp, [KVEvent(STORED, k, tier=tier) for k in keys])


def test_kv_picks_the_group_holding_the_prefix_until_its_load_outweighs_it():
    r = placement(routing_load_weight=1.0)
    keys = prompt_keys(PROMPT, B)
    hold(r, 1, keys[:3])
    groups = [busy(0), busy(0), busy(0)]
    assert r.choose(keys, len(PROMPT), groups, [0, 1, 2]) == (1, 3)  # 3 blocks predicted (no table: blocks)
    groups[1] = busy(40)  # 40 tokens queued < 48 tokens saved: still the holder
    assert r.choose(keys, len(PROMPT), groups, [0, 1, 2])[0] == 1
    groups[1] = busy(60)  # more queued than it saves: another group
    assert r.choose(keys, len(PROMPT), groups, [0, 1, 2])[0] in (0, 2)
    assert r.choose(keys, len(PROMPT), groups, [1])[0] == 1  # only the groups that are up


def test_an_unset_load_weight_takes_the_ranks_device_once_the_engine_knows_it():
    """device=auto: the weight waits for the device the engine resolves at start (engine/lifecycle.py); a set
    weight, 0 included, stays whatever the device."""
    r = placement()
    assert r.weights[2] == 0.5  # before start: the CPU default
    r.resolve_load_weight("cuda")
    assert r.weights[2] == 0.1
    r.resolve_load_weight("cpu")
    assert r.weights[2] == 0.5
    for weight in (0.3, 0.0):
        kept = placement(routing_load_weight=weight)
        kept.resolve_load_weight("cuda")
        assert kept.weights == (1.0, 0.5, weight, 1.0)


def test_primary_is_worth_more_than_host_and_a_gap_ends_the_prefix():
    r = placement()
    keys = prompt_keys(PROMPT, B)
    hold(r, 0, keys[:3], tier=1)
    hold(r, 1, keys[:2], tier=0)
    hold(r, 2, [keys[0], keys[2], keys[3]])  # block 1 missing: only block 0 counts
    assert r.hub.index.prefix(2, keys) == (1, 0)
    groups = [busy(0)] * 3
    assert r.choose(keys, len(PROMPT), groups, [0, 1, 2])[0] == 1  # 2 primary (32) > 3 host (24)
    r = placement(routing_host_weight=1.0)
    hold(r, 0, keys[:3], tier=1)
    hold(r, 1, keys[:2], tier=0)
    assert r.choose(keys, len(PROMPT), groups, [0, 1, 2])[0] == 0


def test_the_last_prompt_token_is_never_predicted_and_ties_go_to_the_lighter_group():
    r = placement()
    keys = prompt_keys(PROMPT, B)
    hold(r, 0, keys)
    assert r.choose(keys, len(PROMPT), [busy(0)] * 3, [0, 1, 2]) == (0, 3)  # the rank matches <= 63 tokens
    r = placement()
    assert r.choose(keys, len(PROMPT), [busy(30), busy(10), busy(20)], [0, 1, 2])[0] == 1


def test_baselines():
    r = placement(routing="least_loaded")
    assert r.choose(None, 10, [busy(5), busy(0), busy(0)], [0, 1, 2])[0] == 1
    r = placement(routing="round_robin")
    assert [r.choose(None, 10, [busy(0)] * 3, [0, 2])[0] for _ in range(3)] == [0, 2, 0]
    assert group_load(busy(7)) == 8  # 7 prompt tokens + 1 to generate


def test_the_routing_record_sums_are_exact_per_salt_top_16_and_other():
    r = RoutingRecord("kv", 3, KVIndex(3, 1 << 30))
    total_p = total_r = 0
    for i in range(40):
        salt = None if i % 10 == 0 else f"tenant-{i % 20}"
        fleet = 2 * i if i % 2 else -1  # the odd ones the fleet's router placed, with its own prediction
        req = types.SimpleNamespace(cache_salt=salt, predicted=i, fleet_predicted=fleet)
        r.count(req, i % 3, i + 1)
        total_p += i
        total_r += i + 1
        assert req.predicted == req.fleet_predicted == -1  # counted once
    rec = r.take()
    assert (rec["requests"], rec["predictedReusedBlocks"], rec["realizedReusedBlocks"]) == (40, total_p, total_r)
    odd = range(1, 40, 2)
    assert rec["fleet"] == {"requests": 20, "predictedReusedBlocks": sum(2 * i for i in odd),
                            "realizedReusedBlocks": sum(i + 1 for i in odd)}
    assert sum(rec["perGroupRequests"]) == 40
    per = rec["perSalt"]
    assert len(per) == TOP_SALTS + 1 and "other" in per
    for k in ("requests", "predictedReusedBlocks", "realizedReusedBlocks"):
        assert sum(s[k] for s in per.values()) == rec[k if k != "requests" else "requests"]
    assert per[salt_label(None)]["requests"] == 4  # the most frequent "salt" is no salt
    assert "tenant-1" not in str(rec)  # salts are named by a label, never shown
    assert r.take()["requests"] == 0  # a fresh tally per record


def test_records_and_metrics_carry_the_routing_sums():
    asm = Assembler("e", 1, 1)
    routing = {"policy": "kv", "requests": 2, "predictedReusedBlocks": 5, "realizedReusedBlocks": 4,
               "perGroupRequests": [2], "perSalt": {}, "indexResyncs": 1}
    (rec,) = asm.ingest([Iteration(0, 0.0, [], (), {}, routing)])
    assert rec["routing"] == routing
    snap = {"epoch": 1, "counts": dict(asm.counts), "last_iter": 0, "buffered": 1, "subscribers": 0,
            "completed": 0, "cluster": asm.cumulative.stats(), "latest": rec, "ranks": {},
            "totals": {"kvCacheIterationStats": {}, "kvCacheIterationStatsByPoolGroup": {}},
            "routing": {k: routing[k] for k in ("requests", "predictedReusedBlocks", "realizedReusedBlocks",
                                                 "indexResyncs")}, "routed_per_group": {"0": 2}}
    text = render_metrics(snap)
    assert "kvfleet_routing_predicted_reused_blocks_total 5.0" in text
    assert "kvfleet_routing_realized_reused_blocks_total 4.0" in text
    assert 'kvfleet_routing_group_requests_total{dp_rank="0"} 2.0' in text


def stream(capacity=100) -> KVEventStream:
    index = types.SimpleNamespace(blocks=[{7: 0, 8: 1}, {}])
    s = KVEventStream(capacity, B, index, buffer_always=True)
    return s


def since(s: KVEventStream, after: str | None) -> list[tuple[str, dict]]:
    """What /kv_events shows of the events after `after`: (id, vLLM-shaped event)."""
    return vllm_events(s.since(after), s.block_size)


def ids(s: KVEventStream, seqs) -> list[str]:
    return [f"{s.incarnation}-{n}" for n in seqs]


def test_the_stream_resumes_without_a_gap_in_vllm_shape():
    s = stream()
    s.publish(0, [KVEvent(STORED, 1, None, tuple(range(16)), 0), KVEvent(STORED, 2, 1, tuple(range(16)), 0)])
    s.publish(1, [KVEvent(MOVED, 5, tier=1), KVEvent(REMOVED, 6, tier=1), KVEvent(CLEARED)])
    start = ids(s, [0])[0]
    assert [i for i, _ in since(s, start)] == ids(s, range(1, 7))  # a move is removed from GPU + stored on CPU
    assert [e["type"] for _, e in since(s, start)] == ["BlockStored", "BlockStored", "BlockRemoved", "BlockStored",
                                                      "BlockRemoved", "AllBlocksCleared"]
    first = since(s, start)[1][1]
    assert first["block_hashes"] == [2] and first["parent_block_hash"] == 1 and first["block_size"] == B
    assert first["medium"] == "GPU" and first["dp_rank"] == 0 and len(first["token_ids"]) == 16
    assert since(s, start)[2][1]["medium"] == "GPU" and since(s, start)[3][1]["medium"] == "CPU"
    for k in range(7):  # any resume point gives exactly what came after it
        assert [i for i, _ in since(s, ids(s, [k])[0])] == ids(s, range(k + 1, 7))


def test_a_client_too_far_behind_gets_an_explicit_resync():
    s = stream(capacity=2)
    s.publish(0, [KVEvent(STORED, k) for k in range(1, 6)])
    assert [i for i, _ in since(s, ids(s, [3])[0])] == ids(s, [4, 5])
    got = since(s, ids(s, [1])[0])  # events 2 and 3 are gone
    assert [e["type"] for _, e in got] == ["AllBlocksCleared", "BlockStored", "BlockStored", "AllBlocksCleared"]
    assert got[0][1]["resync"] and {i for i, _ in got} == set(ids(s, [5]))
    assert got[1][1]["block_hashes"] == [7] and got[2][1]["medium"] == "CPU"
    assert since(s, None)[0][1]["resync"]  # a new client starts from a snapshot too


def test_an_id_of_another_engines_stream_resyncs_however_far_its_seq_got():
    """A replaced engine replica starts a new stream: a client's old Last-Event-ID names nothing in it, even
    once the new stream's seq has passed the old one's."""
    old = stream()
    old.publish(0, [KVEvent(STORED, k) for k in range(100, 105)])
    stale = since(old, ids(old, [0])[0])[-1][0]  # a client followed the old engine up to its 5th event
    new = stream()
    assert new.incarnation != old.incarnation
    new.publish(0, [KVEvent(STORED, k) for k in range(200, 210)])
    got = since(new, stale)
    assert got[0][1]["type"] == "AllBlocksCleared" and got[0][1]["resync"]  # not events 6..10 of the new one
    assert {i for i, _ in got} == set(ids(new, [10]))
    later = since(new, got[-1][0])  # resuming from the resync's id is exact from then on
    new.publish(0, [KVEvent(STORED, 300)])
    assert later == [] and [i for i, _ in since(new, got[-1][0])] == ids(new, [11])
    for bad in ("5", "-1", "", f"{new.incarnation}-x", f"{new.incarnation}-99", f"{new.incarnation}--3"):
        assert since(new, bad)[0][1]["resync"], bad  # malformed, or beyond the newest: a resync


def test_a_stream_nobody_listens_to_converts_nothing():
    s = KVEventStream(10, B, types.SimpleNamespace(blocks=[{}]))
    s.publish(0, [KVEvent(STORED, 1)])
    assert not s.buffer and s.exact_from == s.seq == 1  # a marked gap: a later client resyncs
    assert since(s, ids(s, [0])[0])[0][1]["resync"]


def test_a_salt_label_does_not_let_a_reader_hash_the_salts_prompts():
    prompt = list(range(2 * B))
    for salt in ("tenant-a", "t"):
        label = int(salt_label(salt), 16)  # what /stats shows of the salt
        assert block_key(label, prompt[:B]) != prompt_keys(prompt, B, salt)[0]  # not the chain's root
        assert salt_label(salt) == salt_label(salt) != salt_label(salt + "x")  # stable, one per salt


def test_a_waiting_request_claims_only_what_its_group_does_not_hold_when_it_is_admitted():
    """Requests of one prefix that arrive together are all placed before any has prefilled it (placement
    predicts no reuse); by the time they are admitted the first has published it, and the plan's budget counts
    only each one's uncached tail, as vLLM's scheduler counts what the cache holds: all eight are admitted in
    one step of 160 tokens, not two and a chunk."""
    from collections import deque

    from engine.scheduler import plan_group

    r = placement()
    config = Settings(model="random", dp=3, max_num_batched_tokens=160).engine_config()
    keys = prompt_keys(PROMPT, B)

    def waiting() -> Group:
        reqs = [Request(f"r{i}", PROMPT + [100 + i], SamplingParams(max_tokens=4), None, 4, dp=0) for i in range(8)]
        for req in reqs:
            req.block_keys = keys  # the 4 full blocks all share; the 65th token is each one's own
        return Group(waiting=deque(reqs))

    g = waiting()
    # none held: r0 prefills it
    assert [w.num_scheduled_tokens for w in plan_group(g, 0, config, r.cached_tokens).work] == [65]
    assert [q.id for q in g.waiting] == [f"r{i}" for i in range(1, 8)]  # the rest wait behind it, in order
    hold(r, 0, keys)  # r0 published it
    assert [w.num_scheduled_tokens for w in plan_group(waiting(), 1, config, r.cached_tokens).work] == [1] * 8
    g = waiting()
    g.waiting[0].block_keys = prompt_keys([7] * 64, B)  # another prefix first: none waits for it
    # r1 prefills theirs, r2.. wait for it
    assert [w.num_scheduled_tokens for w in plan_group(g, 2, config).work] == [65, 65]


def test_a_request_placed_behind_its_prefix_waits_for_it_to_be_published():
    """Placement counts a prefix on its way as held (its group draws the request), but admission must not: the
    request admitted beside the one prefilling it would compute the same blocks again (vLLM's prefix
    benchmark recomputed a 512-token prefix five times so, 40% more prefill than its prompts need)."""
    from collections import deque

    from engine.scheduler import plan_group

    r = placement()
    config = Settings(model="random", dp=3, max_num_batched_tokens=1024).engine_config()
    groups = [Group(), busy(0), busy(0)]
    reqs = [Request(f"r{i}", PROMPT + [100 + i], SamplingParams(max_tokens=4), None, 4) for i in range(4)]
    for req in reqs:
        groups[r.place(req, groups, [0])].waiting.append(req)
    assert reqs[1].hit_tokens == len(PROMPT)  # placed behind r0: its prefix counted as on its way
    g = groups[0]
    assert [w.num_scheduled_tokens for w in plan_group(g, 0, config, r.cached_tokens).work] == [65]
    assert list(g.waiting) == reqs[1:]  # behind r0, in order
    reqs[0].num_computed_tokens = len(reqs[0].prompt)
    hold(r, 0, prompt_keys(PROMPT, B))  # r0 prefilled and published it
    assert [w.num_scheduled_tokens for w in plan_group(g, 1, config, r.cached_tokens).work] == [1] * 4  # r0 decodes
    assert not g.waiting and deque(g.running) == deque(reqs)


def test_a_prefix_on_its_way_into_a_group_draws_the_requests_that_share_it():
    r = placement()
    keys = prompt_keys(PROMPT, B)
    groups = [busy(0), busy(0), busy(0)]
    first = Request("first", PROMPT + [1], SamplingParams(max_tokens=1), None, 1, dp=2)
    first.block_keys = keys
    groups[2].waiting.append(first)  # placed, not prefilled yet: nothing in the index
    assert r.choose(keys, len(PROMPT) + 1, groups, [0, 1, 2]) == (2, 4)
    first.num_computed_tokens = len(first.prompt)  # prefilled: what it published is the index's to say
    assert r.choose(keys, len(PROMPT) + 1, groups, [0, 1, 2])[1] == 0


def test_a_rank_alone_on_its_node_takes_every_core_and_busy_ranks_split_them():
    from engine.scheduler import share_cores
    from workers.step import StepPlan, Work

    def busy_plan(i: int) -> StepPlan:
        return StepPlan(i, work=[Work("r", 1)])

    groups = [Group(node="a"), Group(node="a"), Group(node="b")]
    cores = {"a": 2, "b": 8}
    plans = [busy_plan(0), StepPlan(0), busy_plan(0)]
    share_cores(plans, groups, cores, 1)
    assert [p.threads for p in plans] == [2, 0, 8]  # group 1 has nothing to do: group 0 has node a to itself
    plans = [busy_plan(1), busy_plan(1), None]
    share_cores(plans, groups, cores, 1)
    assert [p.threads for p in plans if p] == [1, 1]
    plans = [busy_plan(2), busy_plan(2), busy_plan(2)]
    share_cores(plans, [Group(node="a"), Group(node="a"), Group(node=None)], {"a": 3}, 2)
    assert [p.threads for p in plans] == [2, 2, 2]  # never below a rank's own threads; an unknown node: its own
