"""StatsMirror: one upstream long-poll per replica serves any number of readers, without gaps or repeats."""

import asyncio
import json

from aggregator.actor import WAIT_LIMIT
from deployment.ingress.sse import SSEDecoder
from deployment.ingress.stats.mirror import StatsMirror


class Upstream:
    """The aggregator's read API over a list of records, counting calls."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.calls = 0
        self._new = asyncio.Event()

    def emit(self, n: int = 1) -> None:
        for _ in range(n):
            it = self.records[-1]["iter"] + 1 if self.records else 0
            self.records.append({"iter": it, "kvCacheStats": {"reusedBlocks": it}, "text": "é"})
        self._new.set()
        self._new = asyncio.Event()

    async def query(self, since, limit, ranks):
        self.calls += 1
        out = [dict(r, ranks={}) if ranks else r for r in self.records if r["iter"] > since]
        return out[:limit] if limit is not None else out

    async def wait_records(self, since, timeout_s):
        self.calls += 1
        if not any(r["iter"] > since for r in self.records):
            try:
                await asyncio.wait_for(self._new.wait(), timeout_s)
            except TimeoutError:
                return []
        return [r for r in self.records if r["iter"] > since]

    async def kv_cache_stats(self):
        return {"reusedBlocks": -1}


async def _ids(mirror: StatsMirror, since: int, n: int) -> list[int]:
    dec, out = SSEDecoder(), []
    async for chunk in mirror.events(since):
        for line in chunk.split("\n"):
            ev = dec.feed(line)
            if ev is not None:
                assert json.loads(ev.data)["iter"] == int(ev.id)
                out.append(int(ev.id))
        if len(out) >= n:
            return out


def test_many_readers_share_one_upstream_poll_and_see_every_record_once():
    async def body():
        up = Upstream()
        up.emit(5)
        mirror = StatsMirror(up, keepalive_s=5.0)
        readers = [asyncio.create_task(_ids(mirror, -1, 25)) for _ in range(50)]
        late = asyncio.create_task(_ids(mirror, 9, 15))  # a reconnect with Last-Event-ID 9
        for _ in range(20):
            await asyncio.sleep(0.005)
            up.emit()
        results = await asyncio.wait_for(asyncio.gather(*readers, late), 10)
        assert all(r == list(range(25)) for r in results[:-1])
        assert results[-1] == list(range(10, 25))
        assert up.calls <= 25  # one long-poll per new record at most, not one per reader
        await mirror.close()

    asyncio.run(body())


def test_stats_json_is_the_records_and_reads_wait_for_the_first_copy():
    async def body():
        up = Upstream()
        assert await StatsMirror(up).kv_cache_stats() == {"reusedBlocks": -1}  # nothing mirrored yet
        up.emit(3)
        mirror = StatsMirror(up)
        assert await mirror.page_json(0, 5) == (json.dumps(up.records[1:], separators=(",", ":")), None)
        assert (await mirror.page_json(-1, 2))[1] == 1  # more follow the page: the cursor is its last iter
        assert await mirror.query(-1, 2, False) == up.records[:2]
        assert (await mirror.query(-1, None, True))[0]["ranks"] == {}  # per-rank detail: from the aggregator
        assert await mirror.kv_cache_stats() == {"reusedBlocks": 2}
        await mirror.close()

    asyncio.run(body())


def test_a_mirror_whose_follower_died_fails_the_replica_health_check():
    async def main():
        up = Upstream()

        async def garbled(since, limit, ranks):
            return [{"no_iter": 0}]  # a record the follower cannot read: a bug, not an outage

        up.query = garbled
        m = StatsMirror(up, keepalive_s=0.05)
        m.check()  # not started: healthy
        m.start()
        await asyncio.gather(m._pump, return_exceptions=True)
        try:
            m.check()
        except RuntimeError as e:
            assert "KeyError" in str(e)
        else:
            raise AssertionError("check() passed with a dead follower")
        await m.close()

    asyncio.run(main())


def test_an_interval_never_holds_back_a_backlog():
    async def body():
        up = Upstream()
        up.emit(2500)
        mirror = StatsMirror(up, keepalive_s=5.0)
        writes: list[list[int]] = []

        async def read() -> None:
            async for chunk in mirror.events(-1, interval_s=10.0):
                writes.append([int(line[4:]) for line in chunk.split("\n") if line.startswith("id: ")])
                if writes[-1][-1] == 2499:
                    return

        await asyncio.wait_for(read(), 5)  # not 10 s: full chunks are a reader behind, the next goes at once
        assert [len(w) for w in writes] == [1000, 1000, 500]
        assert [i for w in writes for i in w] == list(range(2500))
        await mirror.close()

    asyncio.run(body())



class CappedUpstream(Upstream):
    """As the actor: a `wait_records` answer holds at most WAIT_LIMIT records, the oldest. `fail`: the next
    `wait_records` answers fail (the long poll in flight too)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.fail = 0
        self.replace(range(n), "a")

    def replace(self, iters, stamp: str) -> None:
        """The aggregator's buffer: these iterations, stamped `stamp` (another stamp is another history)."""
        self.records = [{"iter": i, "timestamp": f"{stamp}{i}"} for i in iters]

    async def wait_records(self, since, timeout_s):
        got = await super().wait_records(since, timeout_s)
        if self.fail:
            self.fail -= 1
            raise ConnectionError("a transient failure")
        return got[:WAIT_LIMIT]


async def _until(cond) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def _caught_up(up: CappedUpstream) -> StatsMirror:
    mirror = StatsMirror(up, keepalive_s=0.2)
    await mirror.ready()
    await _until(lambda: mirror.entries(-1, None)[-1]["record"] is up.records[-1])
    return mirror


def _mirrored(mirror: StatsMirror) -> list[dict]:
    return [e["record"] for e in mirror.entries(-1, None)]


def test_a_failed_call_against_the_same_history_repeats_nothing():
    """A resync once took the capped oldest page of `wait_records(-1)` for another history: it dropped the
    mirror's records, and readers got the whole buffer again."""
    async def body():
        n = 3 * WAIT_LIMIT
        up = CappedUpstream(n)
        mirror = await _caught_up(up)
        got: list[int] = []

        async def read() -> None:
            async for chunk in mirror.events(n - 1):
                got.extend(int(line[4:]) for line in chunk.split("\n") if line.startswith("id: "))

        task = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        up.fail = 1
        up.emit()  # wakes the long poll in flight, which fails
        await _until(lambda: got)
        await asyncio.sleep(0.3)  # anything repeated would follow
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert got == [n] and mirror.generation == 0
        assert _mirrored(mirror) == up.records
        await mirror.close()

    asyncio.run(body())


def test_a_resync_follows_another_history_whatever_the_answer_cap():
    """Our newest record under another timestamp, no record at or after it, or it gone while older ones
    remain: another history, followed from its oldest record."""
    n = 3 * WAIT_LIMIT

    async def body(iters) -> None:
        up = CappedUpstream(n)
        mirror = await _caught_up(up)
        up.replace(iters, "b")
        up.fail = 1
        up.emit()
        await _until(lambda: mirror.generation and _mirrored(mirror) == up.records)
        assert mirror.generation == 1
        await mirror.close()

    for iters in (range(n), range(n - 1000), [*range(n - 1), n + 5]):
        asyncio.run(body(iters))


def test_an_aggregator_past_our_head_continues_our_history():
    """It no longer buffers our newest record, only newer ones (its buffer wrapped, or a restart restored its
    newest): nothing contradicts ours, so the mirror goes on after its head."""
    async def body():
        n = 3 * WAIT_LIMIT
        up = CappedUpstream(n)
        mirror = await _caught_up(up)
        mine = _mirrored(mirror)
        up.replace(range(n + 100, n + 1500), "a")
        up.fail = 1
        up.emit()
        await _until(lambda: _mirrored(mirror)[-1] is up.records[-1])
        assert mirror.generation == 0 and _mirrored(mirror) == mine + up.records
        await mirror.close()

    asyncio.run(body())
