"""StatsHub: one upstream long-poll fanned out to many SSE subscribers, without gaps or repeats."""

import asyncio

from deployment.hub import StatsHub
from deployment.sse import SSEDecoder


class Upstream:
    """The aggregator's query/wait_records over a ring of `keep` records, counting calls."""

    def __init__(self, keep: int = 1000) -> None:
        self.records: list[dict] = []
        self.keep = keep
        self.waits = 0
        self.queries = 0
        self._new = asyncio.Event()

    def emit(self, n: int = 1) -> None:
        for _ in range(n):
            it = self.records[-1]["iter"] + 1 if self.records else 0
            self.records = (self.records + [{"iter": it, "payload": "x" * 10}])[-self.keep:]
        self._new.set()
        self._new = asyncio.Event()

    async def query(self, since: int, limit: int | None, ranks: bool) -> list[dict]:
        self.queries += 1
        out = [r for r in self.records if r["iter"] > since]
        return out[:limit] if limit is not None else out

    async def wait_records(self, since: int, timeout_s: float) -> list[dict]:
        self.waits += 1
        out = [r for r in self.records if r["iter"] > since]
        if out:
            return out
        try:
            await asyncio.wait_for(self._new.wait(), timeout_s)
        except TimeoutError:
            return []
        return [r for r in self.records if r["iter"] > since]


async def _collect(hub: StatsHub, since: int, n: int) -> list[int]:
    dec, out = SSEDecoder(), []
    async for chunk in hub.events(since):
        for line in chunk.split("\n"):
            ev = dec.feed(line)
            if ev is not None:
                out.append(int(ev.id))
        if len(out) >= n:
            return out


def test_fan_out_shares_one_upstream_poll():
    async def body():
        up = Upstream()
        up.emit(5)
        hub = StatsHub(up, keepalive_s=5.0)
        subs = [asyncio.create_task(_collect(hub, -1, 25)) for _ in range(50)]
        for _ in range(20):
            await asyncio.sleep(0.005)
            up.emit()
        got = await asyncio.wait_for(asyncio.gather(*subs), 10)
        assert all(g == list(range(25)) for g in got)
        assert up.waits <= 25, f"{up.waits} upstream long-polls for 50 subscribers"
        assert hub.subscribers == 0

    asyncio.run(body())


def test_subscriber_behind_the_window_catches_up_without_gap():
    async def body():
        up = Upstream(keep=100)
        up.emit(40)
        hub = StatsHub(up, keepalive_s=5.0, window=5)
        fast = asyncio.create_task(_collect(hub, 35, 4))  # starts the pump: window holds the newest 5
        assert await asyncio.wait_for(fast, 5) == [36, 37, 38, 39]
        assert await asyncio.wait_for(_collect(hub, 3, 36), 5) == list(range(4, 40))
        assert up.queries > 0

    asyncio.run(body())


def test_records_that_left_the_upstream_buffer_are_skipped_not_waited_for():
    async def body():
        up = Upstream(keep=10)
        up.emit(30)  # iterations 0..19 are gone upstream
        hub = StatsHub(up, keepalive_s=5.0, window=10)
        assert await asyncio.wait_for(_collect(hub, 2, 10), 5) == list(range(20, 30))

    asyncio.run(body())


def test_idle_stream_sends_keepalive():
    async def body():
        up = Upstream()
        hub = StatsHub(up, keepalive_s=0.05)
        agen = hub.events(-1)
        assert (await asyncio.wait_for(agen.__anext__(), 5)).startswith(": keepalive")
        await agen.aclose()
        assert hub.subscribers == 0

    asyncio.run(body())
