"""The fleet's `kv` router over in-process engines (no Ray): two engines stand in for two engine replicas, the
follower is fed what each engine's `follow` answers, and the router's choice goes back into the engine as
`placed`, as the Serve deployment does it (engine/serve.py)."""

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import ray

from deployment.router.fleet_view import SENT_S, FleetFollower, FleetView, Sent, place
from engine.messages import ADMITTED, FollowReport, GenerateRequest, KVStreamEvent
from kvcache.events import REMOVED, KVEvent, prompt_keys
from tests.support.engine_harness import make_engine, settled, until
from workers.sampling_params import SamplingParams

B = 16
TENANT_A = list(range(1, 97))  # 6 full blocks
TENANT_B = list(range(101, 197))


def run(coro):
    return asyncio.run(coro)


def replica(rid: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid))


class Fleet:
    """Engines by replica id, the view and the follower (its `_apply` fed by hand), as the router sees them."""

    def __init__(self, engines: dict) -> None:
        self.engines = engines
        self.view = FleetView()
        self.weights = (1.0, 0.5, 0.5, 1.0)  # the routing_* settings' defaults
        self.follower = FleetFollower(None, self.view)
        self.after = dict.fromkeys(engines)
        self.admitted: dict[str, int] = {}  # per replica: this router's newest ticket it admitted
        self.view.set_live(frozenset(engines))
        self.replicas = [replica(rid) for rid in engines]

    async def sync(self) -> None:
        """One follow answer per replica, as KVFleetEngine.follow gives it."""
        for rid, eng in self.engines.items():
            await settled(eng)
            got = FollowReport(rid, eng.config.engine_id, eng.config.cache.tokens_per_block,
                               await eng.kv_events(self.after[rid], 0.0), eng.groups_state(),
                               {self.view.id: self.admitted.get(rid, -1)})
            self.after[rid] = self.follower._apply(rid, got)

    async def ask(self, prompt, salt=None, max_tokens=3):
        """Route (as Serve would: the first replica of the first rank), then run it there; the chosen rid."""
        routed = GenerateRequest(prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt)
        ranked = place(self.view, self.weights, [r for r in self.replicas if r.replica_id.unique_id in self.view.live],
                       routed)
        rid = ranked[0][0].replica_id.unique_id
        eng = self.engines[rid]
        self.admitted[rid] = routed.ticket
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        async for _ in eng.generate(None, prompt, params, salt, placed=routed.placed(eng.config.engine_id)):
            pass
        await self.sync()
        return rid, routed


async def two_engines(dp=1):
    engines = {}
    for n in range(2):
        engines[f"r{n}"] = await make_engine(dp=dp, kv_cache_bytes=2 << 20, max_seq_len=256, engine_id=f"e-{n}")
    fleet = Fleet(engines)
    await fleet.sync()
    return fleet


def test_the_replica_holding_the_prefix_gets_it_and_predicted_equals_realized():
    async def main():
        fleet = await two_engines()
        first_a, _ = await fleet.ask(TENANT_A + [200])
        first_b, _ = await fleet.ask(TENANT_B + [200])
        assert first_a != first_b  # nothing held anywhere: the tie goes to the replica holding fewer blocks
        for i in range(3):
            rid, routed = await fleet.ask(TENANT_A + [210 + i])
            assert rid == first_a and routed.blocks == 6 and routed.dp == 0
            assert routed.engine == fleet.engines[first_a].config.engine_id
            rid, _ = await fleet.ask(TENANT_B + [210 + i])
            assert rid == first_b
        for rid, eng in fleet.engines.items():
            rec = eng.routing_record.take()
            fleet_rec = rec["fleet"]
            assert fleet_rec["requests"] == rec["requests"] == 4  # every request was placed by the fleet
            assert fleet_rec["predictedReusedBlocks"] == fleet_rec["realizedReusedBlocks"] \
                == 3 * eng.placement.reuse_table[6] > 0
            # the router's index of each replica is exactly what its rank holds
            assert fleet.view.replicas[rid].index.blocks == eng.hub.index.blocks

    run(main())


def test_the_fleet_predicts_the_block_a_rank_reuses_in_part_as_the_engine_does():
    """One rule at both levels: the router's index holds the unsalted blocks' tokens from the replica's event
    stream, so it predicts the partial reuse past the held full blocks, as the engine does and the rank realizes."""
    async def main():
        fleet = await two_engines()
        first, _ = await fleet.ask(TENANT_A + [200, 201, 202, 203])  # publishes a trailing block [200, 201, ...]
        for eng in fleet.engines.values():
            eng.routing_record.take()
        rid, routed = await fleet.ask(TENANT_A + [200, 201, 77, 78])
        assert rid == first and routed.blocks == 6 and routed.partial == 2
        eng = fleet.engines[rid]
        rec = eng.routing_record.take()
        want = eng.placement.reuse_table[6] + eng.placement.partial_worth
        assert rec["fleet"]["predictedReusedBlocks"] == rec["fleet"]["realizedReusedBlocks"] == want
        assert rec["predictedReusedBlocks"] == want

    run(main())


def test_the_chosen_dp_group_is_where_the_engine_puts_it():
    async def main():
        fleet = await two_engines(dp=2)
        rid, routed = await fleet.ask(TENANT_A + [200])
        again_rid, again = await fleet.ask(TENANT_A + [201])
        assert (again_rid, again.dp) == (rid, routed.dp) and again.blocks == 6
        eng = fleet.engines[rid]
        assert eng.hub.index.prefix(routed.dp, prompt_keys(TENANT_A, B)) == (6, 0)
        assert eng.routing_record.take()["perGroupRequests"][routed.dp] == 2

    run(main())


def test_salts_stay_in_the_keys_across_replicas():
    async def main():
        fleet = await two_engines()
        rid, _ = await fleet.ask(TENANT_A + [200], salt="t1")
        _, other = await fleet.ask(TENANT_A + [201], salt="t2")  # the same text, another tenant: no hit anywhere
        assert other.blocks == 0
        same_rid, same = await fleet.ask(TENANT_A + [202], salt="t1")
        assert same_rid == rid and same.blocks == 6

    run(main())


def test_load_outweighs_a_small_hit():
    async def main():
        fleet = await two_engines()
        short = TENANT_A[:33]  # two full blocks held
        rid, _ = await fleet.ask(short + [200])
        fleet.view.replicas[rid].sent.append(Sent(1 << 40, 0, 10_000, 0, [], time.monotonic()))  # not reported
        other, routed = await fleet.ask(short + [201])
        assert other != rid and routed.blocks == 0

    run(main())


def test_what_the_router_sent_counts_until_the_replica_reports_it():
    async def main():
        fleet = await two_engines()
        rid, routed = await fleet.ask(TENANT_A + [200])
        view = fleet.view.replicas[rid]
        assert view.sent == []  # admitted and reported: the engine's own load and room count it now
        second = GenerateRequest(TENANT_A + [201], SamplingParams(max_tokens=5))
        place(fleet.view, fleet.weights, fleet.replicas, second)  # decided, not sent yet
        assert second.ticket == routed.ticket + 1 and second.router == fleet.view.id
        assert view.pending(0) == (97 + 5 - 6 * B, 7 - 6)  # what is not cached; blocks beyond the held 6
        await fleet.sync()  # a report that has not seen it: still pending
        assert view.pending(0) == (97 + 5 - 6 * B, 1)
        fleet.admitted[rid] = second.ticket
        await fleet.sync()
        assert view.pending(0) == (0, 0)

    run(main())

def test_a_burst_of_one_prompt_stays_together_before_its_blocks_show():
    """Blocks of a prompt sent to a replica count as held there before its events arrive: the tenant's next
    requests follow it instead of warming a second replica."""
    async def main():
        fleet = await two_engines()
        burst = [GenerateRequest(TENANT_A + [200 + i], SamplingParams(max_tokens=3)) for i in range(3)]
        ranked = [place(fleet.view, fleet.weights, fleet.replicas, r) for r in burst]  # none sent yet
        assert len({r[0][0].replica_id.unique_id for r in ranked}) == 1
        assert [r.blocks for r in burst] == [0, 6, 6]

    run(main())


def test_a_replica_that_leaves_is_forgotten_at_once_and_a_new_one_starts_from_its_snapshot():
    async def main():
        fleet = await two_engines()
        rid, _ = await fleet.ask(TENANT_A + [200])
        survivor = next(r for r in fleet.engines if r != rid)
        fleet.view.set_live(frozenset({survivor}))  # Serve's replica set without it (it died)
        assert rid not in fleet.view.replicas
        moved, routed = await fleet.ask(TENANT_A + [201])
        assert moved == survivor and routed.blocks == 0
        # Serve's replacement: a new replica id for the same engine, followed from its (empty) snapshot
        fresh = await make_engine(dp=1, kv_cache_bytes=2 << 20, max_seq_len=256,
                                  engine_id=fleet.engines[rid].config.engine_id)
        fleet.engines["r9"], fleet.after["r9"] = fresh, None
        fleet.replicas.append(replica("r9"))
        fleet.view.set_live(frozenset({survivor, "r9"}))
        await fleet.sync()
        assert fleet.view.replicas["r9"].index.blocks == [{}]
        back, routed = await fleet.ask(TENANT_A + [202])
        assert back == survivor and routed.blocks == 6  # the survivor holds it now

    run(main())


def test_an_event_that_does_not_fit_asks_for_a_snapshot():
    async def main():
        fleet = await two_engines()
        rid, _ = await fleet.ask(TENANT_A + [200])
        view = fleet.view.replicas[rid]
        bogus = KVStreamEvent("x-1", 0, 0.0, (KVEvent(REMOVED, 12345),))  # an unknown block removed
        assert fleet.follower._apply(rid, FollowReport(rid, view.engine, B, [bogus],
                                                       view.groups)) is None  # resume from a snapshot
        assert view.index.resync[0]
        fleet.after[rid] = None
        await fleet.sync()
        assert view.index.blocks == fleet.engines[rid].hub.index.blocks and not view.index.resync[0]
        malformed = KVStreamEvent("x-2", 0, 0.0, (KVEvent(99),))  # a kind this stream never sends
        assert fleet.follower._apply(rid, FollowReport(rid, view.engine, B, [malformed],
                                                       view.groups)) is None

    run(main())


def test_the_router_serve_ships_by_value_shares_the_ingress_view_and_routed_class():
    """Serve pickles a router's module by value into each handle's process: a `GenerateRequest` or a view defined there
    would be a private copy, blind to what the ingress sends and the follower writes (it was, once)."""
    import subprocess
    import sys

    from ray.serve.config import RequestRouterConfig

    blob = RequestRouterConfig(request_router_class="deployment.router.request_router:KVFleetRouter") \
        .get_serialized_request_router_cls()
    check = (
        "import sys; from ray import cloudpickle; import deployment.router.fleet_view as f\n"
        "cls = cloudpickle.loads(sys.stdin.buffer.read())\n"
        "g = cls.choose_replicas.__globals__\n"
        "assert g['routed_of'] is f.routed_of and g['place'] is f.place, 'copies'\n"
        "r = object.__new__(cls); r._deployment_id = type('D', (), {'app_name': 'a', 'name': 'd'})()\n"
        "r.initialize_state(load_weight=0.5); assert r.view is f.fleet_view('a', 'd')\n")
    done = subprocess.run([sys.executable, "-c", check], input=blob, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def kv_router(fleet: Fleet):
    """Serve's router over the fleet's view, without Serve's own state (choose_replicas needs none of it)."""
    from deployment.router.request_router import KVFleetRouter

    router = object.__new__(KVFleetRouter)
    router.view, router.weights = fleet.view, fleet.weights
    return router


def pending(routed: GenerateRequest):
    """Serve's PendingRequest of a generate call (made in a running loop: it holds a future)."""
    from ray.serve._private.request_router.common import PendingRequest

    return PendingRequest(args=[None, routed.token_ids, None, routed.cache_salt, 0, routed], kwargs={}, metadata=None)


async def serves_first_rank(router, request, replicas: list) -> list:
    """The first rank Serve's own routing loop (RequestRouter._choose_replicas_with_backoff) tries. On an empty
    answer it asks the router again at once, awaiting nothing: after 100 asks this fails instead of hanging."""
    asks = []
    choose = router.choose_replicas

    async def counted(candidate_replicas, pending_request):
        asks.append(1)
        assert len(asks) < 100, "Serve's routing loop asked 100 times and got no replica"
        return await choose(candidate_replicas, pending_request)

    router.choose_replicas = counted
    router._replicas, router._replicas_list = dict(enumerate(replicas)), replicas
    router.num_routing_tasks_in_backoff = 0
    router.num_routing_tasks_in_backoff_gauge = SimpleNamespace(set=lambda n: None)
    loop = router._choose_replicas_with_backoff(request)
    try:
        return await anext(loop)
    finally:
        await loop.aclose()


async def groups_down(fleet: Fleet) -> tuple[asyncio.Event, list]:
    """Every engine's only group dies at its next step (a request of its own takes it there), and is restarted
    once the returned gate is set; those requests (waiting in their engines meanwhile) are returned too."""
    gate = asyncio.Event()
    waiting = []
    for eng in fleet.engines.values():
        async def held(dp, launch=eng._launch):
            await gate.wait()
            return await launch(dp)

        def dead(plan):
            raise ray.exceptions.ActorDiedError()

        eng._launch, eng.workers[0].fail = held, dead
        params = SamplingParams(max_tokens=2, temperature=0.0)
        waiting.append(asyncio.ensure_future(anext(eng.generate(None, TENANT_B + [250], params))))
        await until(lambda eng=eng: eng._groups[0].down is not None, "the group's death")
    await fleet.sync()
    return gate, waiting


def test_with_no_group_up_anywhere_a_request_goes_to_a_replica_and_waits_in_its_engine():
    """No dp group up on any replica: the router still answers Serve with every replica (an empty answer had
    Serve's routing task ask again at once, for good, and the ingress 503 the request at its admission
    timeout); the engine admits it and keeps it waiting, up to placement_timeout_s, for a group to come back."""
    async def main():
        fleet = await two_engines()
        gate, waiting = await groups_down(fleet)
        assert all(not g.up for v in fleet.view.replicas.values() for g in v.groups)
        routed = GenerateRequest(TENANT_A + [200], SamplingParams(max_tokens=3))
        request = pending(routed)
        tried = await serves_first_rank(kv_router(fleet), request, fleet.replicas)
        assert tried == fleet.replicas  # Serve takes the shortest queue among them
        assert request.routing_context.should_backoff  # all of them full: Serve pauses before asking again
        assert routed.ticket == -1 and all(not v.sent for v in fleet.view.replicas.values())
        eng = fleet.engines[tried[0].replica_id.unique_id]
        assert routed.placed(eng.config.engine_id) is None  # the engine places it itself, once a group is up
        stream = eng.generate(None, routed.token_ids, SamplingParams(max_tokens=3, temperature=0.0), announce=True)
        assert await anext(stream) is ADMITTED  # admitted at once: the ingress stops waiting
        assert len(eng._orphans) == 2  # it waits in the engine, with the request that took the group down
        gate.set()
        assert len([ev async for ev in stream]) == 3
        await asyncio.gather(*waiting)

    run(main())


def test_replicas_with_no_group_up_rank_after_every_other():
    async def main():
        fleet = await two_engines()
        down = fleet.replicas[0].replica_id.unique_id
        view = fleet.view.replicas[down]
        view.report([dataclasses.replace(g, up=False) for g in view.groups], view.admitted)
        fresh = replica("r-new")  # live, not followed yet
        fleet.view.set_live(fleet.view.live | {"r-new"})
        routed = GenerateRequest(TENANT_A + [200], SamplingParams(max_tokens=3))
        ranked = place(fleet.view, fleet.weights, [*fleet.replicas, fresh], routed)
        assert ranked == [[fleet.replicas[1]], [fresh], [fleet.replicas[0]]]
        assert routed.engine == fleet.engines["r1"].config.engine_id

    run(main())


async def routed_call():
    """Two engines, a kv router over them, and one generate call's `GenerateRequest` as Serve's pending request."""
    fleet = await two_engines()
    routed = GenerateRequest(TENANT_A + [200], SamplingParams(max_tokens=3))
    return fleet, kv_router(fleet), routed, pending(routed)


def test_a_decision_serve_sent_to_another_replica_leaves_the_chosen_ones_load_at_once():
    """The chosen replica was full, and Serve took one of the next rank: its `on_request_routed` says which."""
    async def main():
        fleet, router, routed, request = await routed_call()
        (chosen,), (other,) = await router.choose_replicas(fleet.replicas, request)
        view = fleet.view.replicas[chosen.replica_id.unique_id]
        assert [s.ticket for s in view.sent] == [routed.ticket] and view.pending(0) != (0, 0)
        router.on_request_routed(request, other.replica_id, None)
        assert view.sent == [] and view.pending(0) == (0, 0)
        assert fleet.view.replicas[other.replica_id.unique_id].sent == []  # its own report will count it

        kept = GenerateRequest(TENANT_A + [201], SamplingParams(max_tokens=3))
        request = pending(kept)
        (chosen,), _ = await router.choose_replicas(fleet.replicas, request)
        router.on_request_routed(request, chosen.replica_id, None)  # where it was meant to go: it stays
        assert [s.ticket for s in fleet.view.replicas[chosen.replica_id.unique_id].sent] == [kept.ticket]

    run(main())


def test_a_request_routed_again_leaves_no_trace_of_its_last_decision():
    """A replica that rejected the request (full), or died before taking it: Serve routes it again."""
    async def main():
        fleet, router, routed, request = await routed_call()
        await router.choose_replicas(fleet.replicas, request)
        first = routed.ticket
        await router.choose_replicas(fleet.replicas, request)
        tickets = [s.ticket for v in fleet.view.replicas.values() for s in v.sent]
        assert tickets == [routed.ticket] and routed.ticket != first

    run(main())


def test_a_decision_no_report_accounts_for_counts_sent_s_at_most():
    """Cancelled before it was sent, or sent where Serve did not say: without a bound it weighed for good."""
    async def main():
        fleet = await two_engines()
        rid = fleet.replicas[0].replica_id.unique_id
        view = fleet.view.replicas[rid]
        now = time.monotonic()
        view.sent += [Sent(1 << 40, 0, 10_000, 50, [], now - SENT_S - 1), Sent(1 << 41, 0, 7, 1, [], now)]
        assert view.pending(0) == (10_007, 51)
        place(fleet.view, fleet.weights, fleet.replicas,
              GenerateRequest(TENANT_B + [200], SamplingParams(max_tokens=3)))
        assert [s.ticket for s in view.sent if s.ticket >= 1 << 40] == [1 << 41]
        view.sent.append(Sent(1 << 42, 0, 10_000, 50, [], now - SENT_S - 1))
        await fleet.sync()  # a report prunes too (it does not admit tickets of another router's numbering)
        assert 1 << 42 not in [s.ticket for s in view.sent]

    run(main())


def test_an_engine_replica_forgets_the_least_recently_updated_router_first():
    """The cap on the routers an engine replica reports: a live router keeps its place by routing there."""
    from engine.serve import MAX_ROUTERS, KVFleetEngine

    class Engine:
        config = SimpleNamespace(engine_id="e-0")

        async def generate(self, *args, **kwargs):
            yield ADMITTED

    class Replica(KVFleetEngine.func_or_class):
        def __del__(self) -> None:  # no engine to shut down
            pass

    replica = object.__new__(Replica)
    replica._engine = Engine()
    replica._tickets = {f"old-{n}": n for n in range(MAX_ROUTERS)}

    async def admit(router: str, ticket: int) -> None:
        routed = GenerateRequest([1], engine="e-0", dp=0, router=router, ticket=ticket)
        async for _ in replica.generate(routed):
            pass

    async def main():
        await admit("old-0", 100)  # the oldest entry, and live
        await admit("new", 0)
        assert replica._tickets["old-0"] == 100 and "old-1" not in replica._tickets
        assert len(replica._tickets) == MAX_ROUTERS and list(replica._tickets)[-2:] == ["old-0", "new"]

    run(main())
