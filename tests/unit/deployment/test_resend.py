"""The ingress re-sends a request whose engine replica died (deployment/ingress/resend.py), over a fake handle whose
"replicas" are real in-process engines (no Ray cluster): the tokens equal a run without the fault, greedy and
seeded; an unseeded sampled request keeps one seed; a refusal is not re-sent; the deadline gives a 503."""

import asyncio
import contextlib
import itertools

import pytest
import ray

from deployment.ingress import resend
from deployment.ingress.engine_client import EngineClient
from engine.errors import EngineError, EngineStopping, Overloaded, RequestError
from engine.messages import ADMITTED, EngineInfo
from tests.support.engine_harness import generate, make_engine
from workers.sampling_params import SamplingParams
from workers.tokenizer import ByteTokenizer

PROMPT = list(range(1, 20))
GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = dict(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
UNSEEDED = dict(max_tokens=12, temperature=0.9, ignore_eos=True)


def run(coro):
    return asyncio.run(coro)


class Stream:
    """What the handle's streaming call returns: ADMITTED once admitted, token events, `cancel()`. With `die_after`,
    the replica dies (ActorDiedError) after that many token events; `fail` raises instead of admitting."""

    def __init__(self, events, die_after: int | None = None, fail: BaseException | None = None) -> None:
        self._events, self._left, self._fail = events, die_after, fail
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._fail is not None:
            raise self._fail
        ev = await anext(self._events)
        if ev is not ADMITTED and self._left is not None:
            if self._left == 0:
                raise ray.exceptions.ActorDiedError()
            self._left -= 1
        return ev

    def cancel(self) -> None:
        self.cancelled = True
        if self._events is not None:
            asyncio.ensure_future(self._events.aclose())  # the engine aborts the request, as a replica does


class Handle:
    """A deployment handle over `replicas` (one fake engine replica each, in turn): replica i dies after
    `die_after[i]` tokens, or raises `fail[i]` instead of admitting; `calls` records every send."""

    def __init__(self, replicas: list, die_after: dict | None = None, fail: dict | None = None) -> None:
        self.replicas, self.die_after, self.fail = replicas, die_after or {}, fail or {}
        self.calls: list[tuple] = []
        self.generate = self
        self.transport: dict = {}

    def options(self, stream: bool, **transport) -> "Handle":
        self.transport = transport
        return self

    def remote(self, req) -> Stream:
        rid, prompt, params, salt, num_output_tokens = (req.request_id, req.token_ids, req.params, req.cache_salt,
                                                        req.num_output_tokens)
        i = len(self.calls)
        self.calls.append((rid, list(prompt), params, num_output_tokens))
        eng = self.replicas[min(i, len(self.replicas) - 1)]
        if isinstance(eng, BaseException):
            return Stream(None, fail=eng)
        events = eng.generate(rid, prompt, params, salt, announce=True, num_output_tokens=num_output_tokens)
        return Stream(events, self.die_after.get(i), self.fail.get(i))


def client(handle: Handle, resend_s: float = 5.0) -> EngineClient:
    return EngineClient(handle, ByteTokenizer(), EngineInfo(256, 256, 256),
                        resend_s)


async def tokens(events) -> list[int]:
    first = await anext(events)
    assert first is ADMITTED  # admitted, once, however many replicas it took
    return [ev.token_id async for ev in events]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_whose_replica_dies_mid_stream_gets_the_tokens_of_a_run_without_fault(params):
    async def main():
        expected = await generate(await make_engine(), PROMPT, **params)
        handle = Handle([await make_engine(), await make_engine(), await make_engine()], die_after={0: 5, 1: 3})
        got = await tokens(client(handle).generate("cmpl-1", PROMPT, SamplingParams(**params)))
        assert got == expected  # no gap, no repeat, through two deaths
        (rid0, p0, s0, d0), (rid1, p1, s1, d1), (rid2, p2, s2, d2) = handle.calls
        assert (rid0, p0, s0.max_tokens, d0) == ("cmpl-1", PROMPT, 12, 0)
        assert (rid1, p1, s1.max_tokens, d1) == ("cmpl-1-resend1", PROMPT + expected[:5], 7, 5)
        assert (rid2, p2, s2.max_tokens, d2) == ("cmpl-1-resend2", PROMPT + expected[:8], 4, 8)

    run(main())


@pytest.mark.parametrize("transport", ["grpc", "actor_calls"])
def test_token_streams_go_over_the_transport_the_setting_names(transport):
    """`token_transport`: grpc asks Serve's handle for its gRPC transport with plain pickle, actor_calls for
    Serve's default (Ray actor calls); either way the request streams the same tokens."""
    async def main():
        handle = Handle([await make_engine()])
        eng = EngineClient(handle, ByteTokenizer(), EngineInfo(256, 256, 256), 5.0, transport=transport)
        got = await tokens(eng.generate("cmpl-1", PROMPT, SamplingParams(**GREEDY)))
        return handle.transport, got

    options, got = run(main())
    want = {"_by_reference": False, "request_serialization": "pickle", "response_serialization": "pickle"}
    assert options == (want if transport == "grpc" else {})
    assert len(got) == GREEDY["max_tokens"]


def test_an_unseeded_sampled_request_keeps_the_seed_the_ingress_picked_before_its_first_send():
    async def main():
        handle = Handle([await make_engine(), await make_engine()], die_after={0: 4})
        got = await tokens(client(handle).generate("cmpl-2", PROMPT, SamplingParams(**UNSEEDED)))
        seeds = {params.seed for _, _, params, _ in handle.calls}
        assert len(handle.calls) == 2 and len(seeds) == 1 and None not in seeds
        assert got == await generate(await make_engine(), PROMPT, **{**UNSEEDED, "seed": seeds.pop()})

    run(main())


def test_a_replica_lost_before_admitting_is_tried_again_and_the_caller_sees_one_admission():
    async def main():
        handle = Handle([ray.exceptions.ActorUnavailableError("unreachable", None), await make_engine()])
        got = await tokens(client(handle).generate("cmpl-3", PROMPT, SamplingParams(**GREEDY)))
        assert got == await generate(await make_engine(), PROMPT, **GREEDY)
        assert [c[3] for c in handle.calls] == [0, 0]

    run(main())


@pytest.mark.parametrize("refusal", [RequestError("bad", "invalid_request"), Overloaded("full", 2.0),
                                     EngineError("no dp group is up", 5.0)], ids=["400", "429", "503"])
def test_a_refusal_of_a_live_engine_is_not_re_sent(refusal):
    async def main():
        as_ray = ray.exceptions.RayTaskError("generate", "traceback", refusal).as_instanceof_cause()
        assert not resend.replica_lost(as_ray)  # what a live replica's error looks like through the handle
        handle = Handle([await make_engine(), await make_engine()], die_after={0: 3}, fail={1: as_ray})
        events = client(handle).generate("cmpl-4", PROMPT, SamplingParams(**GREEDY))
        with pytest.raises(type(refusal)) as caught:
            await tokens(events)
        assert len(handle.calls) == 2 and str(caught.value) == str(refusal)

    run(main())


def test_a_lost_request_that_no_replica_takes_in_time_is_a_503(monkeypatch):
    async def main():
        never = asyncio.Event()

        class Gone:  # Serve queues the call while no replica is up: it is never admitted
            def generate(self, *a, **k):
                return self._wait()

            async def _wait(self):
                await never.wait()
                yield ADMITTED

        handle = Handle([await make_engine(), ray.exceptions.ActorDiedError()], die_after={0: 2})
        events = client(handle, resend_s=0.3).generate("cmpl-5", PROMPT, SamplingParams(**GREEDY))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(EngineError) as caught:
            await tokens(events)
        took = loop.time() - t0
        assert "no replica took the request again within 0.3 s" in str(caught.value)
        assert caught.value.retry_after_s >= 1 and 0.3 <= took < 3
        assert 3 <= len(handle.calls) <= 12  # re-sent with backoff, not in a busy loop

        handle = Handle([await make_engine(), Gone()], die_after={0: 2})
        events = client(handle, resend_s=0.3).generate("cmpl-6", PROMPT, SamplingParams(**GREEDY))
        with pytest.raises(EngineError, match="within 0.3 s"):
            await tokens(events)
        assert len(handle.calls) == 2

    run(main())


def test_a_new_request_waits_placement_timeout_s_for_a_replica_as_a_re_sent_one_does():
    """No replica is up (Serve queues the call while one starts): the request is admitted when one comes, well
    past the old fixed 10 s when the setting says so, and is a 503 naming the setting's time otherwise."""
    async def main():
        class Late:  # the replacement replica comes up after `after` seconds and admits the request then
            def __init__(self, engine, after: float) -> None:
                self.engine, self.after = engine, after

            async def generate(self, *args, **kwargs):
                await asyncio.sleep(self.after)
                async for ev in self.engine.generate(*args, **kwargs):
                    yield ev

        ref = await tokens(client(Handle([await make_engine()])).generate("a", PROMPT, SamplingParams(**GREEDY)))
        handle = Handle([Late(await make_engine(), 0.5)])
        got = await tokens(client(handle, resend_s=2.0).generate("b", PROMPT, SamplingParams(**GREEDY)))
        assert got == ref and len(handle.calls) == 1
        handle = Handle([Late(await make_engine(), 5.0)])
        with pytest.raises(EngineError, match="did not answer within 0.2 s"):
            await tokens(client(handle, resend_s=0.2).generate("c", PROMPT, SamplingParams(**GREEDY)))

    run(main())


def test_the_first_admission_keeps_its_own_timeout(monkeypatch):
    async def main():
        monkeypatch.setattr(resend, "RESEND_BACKOFF_S", (0.01, 0.02))
        calls = itertools.count()

        async def unreachable(rid, prompt, params, num_output_tokens):
            next(calls)
            raise ray.exceptions.ActorUnavailableError("unreachable", None)
            yield

        with pytest.raises(EngineError, match="did not answer within 0.2 s"):
            async for _ in resend.resending(Cancellable(unreachable), "r", PROMPT, SamplingParams(), 0.2, 30.0):
                pass
        assert next(calls) > 2

    run(main())


class Cancellable:
    """`send` for `resend.resending` from an async generator function: its streams get `cancel()`."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, *args):
        gen = self.fn(*args)
        return type("S", (), {"__aiter__": lambda s: s, "__anext__": lambda s: anext(gen),
                              "cancel": lambda s: None})()


def test_rays_prefix_router_reads_the_prompt_text_from_what_the_ingress_sends():
    """fleet_routing=prefix_affinity: Ray Serve LLM's router takes the text of a `prompt` attribute of a
    positional argument of the handle call; without one it raises for every request."""
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
    from ray.serve._private.request_router.common import PendingRequest

    sent = []

    class Capture:
        generate = None

        def options(self, stream, **transport):
            return self

        def remote(self, *args):
            sent.append(args)
            raise ray.exceptions.RayTaskError("generate", "stop here", RuntimeError("stop"))

    handle = Capture()
    handle.generate = handle
    prompt = ByteTokenizer().encode("You are a helpful assistant. Tenant 7 asks:")
    eng = EngineClient(handle, ByteTokenizer(), EngineInfo(256, 256, 256),
                       5.0, routing="prefix_affinity")

    async def main():
        with contextlib.suppress(Exception):
            await anext(eng.generate("cmpl-1", prompt, SamplingParams(**GREEDY)))
        router = object.__new__(PrefixCacheAffinityRouter)  # its text extraction needs none of its state
        pending = PendingRequest(args=list(sent[0]), kwargs={}, metadata=None)  # (made in a loop: a future)
        return router._extract_text_from_request(pending)

    assert run(main()) == ByteTokenizer().decode(prompt)


class StoppingHandle(Handle):
    """Replica 0 shuts its engine down (as Serve stops a replica) after `stop_after` token events."""

    def __init__(self, replicas: list, stop_after: int) -> None:
        super().__init__(replicas)
        self.stop_after = stop_after
        self.streamed = 0  # token events replica 0 gave (a step already sent when it stopped may add one)

    def remote(self, req) -> Stream:
        stream = super().remote(req)
        if len(self.calls) == 1:
            stream._events = self._stops(stream._events, self.replicas[0])
        return stream

    async def _stops(self, events, engine):
        async for ev in events:
            yield ev
            self.streamed += ev is not ADMITTED
            if self.streamed == self.stop_after:
                await engine.shutdown()


def test_a_request_on_a_replica_that_stops_mid_stream_is_re_sent_whole():
    """A scale-down: Serve stops a replica whose engine still runs the request (its drain timed out); the
    engine's shutdown hands it back (EngineStopping), and the ingress sends it on with the tokens so far."""
    async def main():
        expected = await generate(await make_engine(), PROMPT, **GREEDY)
        handle = StoppingHandle([await make_engine(), await make_engine()], stop_after=4)
        got = await tokens(client(handle).generate("cmpl-9", PROMPT, SamplingParams(**GREEDY)))
        assert got == expected
        assert handle.streamed >= 4
        assert [c[3] for c in handle.calls] == [0, handle.streamed]  # the re-send carried the tokens streamed
        through_ray = ray.exceptions.RayTaskError("generate", "tb", EngineStopping("stopping")).as_instanceof_cause()
        assert resend.replica_lost(through_ray)  # what the handle raises for it

    run(main())
