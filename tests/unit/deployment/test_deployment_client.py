"""deployment.clients.client against an httpx.MockTransport: paging, errors, and SSE reconnection by Last-Event-ID."""

import json

import httpx
import pytest

from deployment.clients.client import StatsClient, StatsError
from deployment.ingress.sse import format_comment, format_event

RECORDS = [{"iter": i, "kvCacheStats": {"reusedBlocks": i}} for i in range(10)]


class DroppingStream(httpx.SyncByteStream):
    """Sends some events, then the connection breaks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self):
        yield from self.chunks
        raise httpx.ReadError("connection reset")


def _server(drop_after: int):
    seen_headers: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/stats":  # pages as the server's: Link rel="next" while more records follow
            since = int(request.url.params.get("since", -1))
            limit = int(request.url.params.get("limit", 4))
            out = [r for r in RECORDS if r["iter"] > since]
            if len(out) <= limit:
                return httpx.Response(200, json=out)
            after = request.url.copy_merge_params({"since": out[limit - 1]["iter"]})
            return httpx.Response(200, json=out[:limit], headers={"Link": f'<{after}>; rel="next"'})
        if request.url.path == "/stats/ranks/9":
            return httpx.Response(404, json={"error": {"message": "unknown rank 9", "type": "x",
                                                       "code": "unknown_rank"}})
        if request.url.path == "/stats/stream":
            header = request.headers.get("last-event-id")
            seen_headers.append(header)
            start = int(header) if header is not None else int(request.url.params.get("since", -1))
            # resends the record named by Last-Event-ID: the client must drop that duplicate
            pending = [r for r in RECORDS if r["iter"] >= start][:drop_after]
            chunks = [format_comment("keepalive").encode()]
            chunks += [format_event(json.dumps(r), id=r["iter"], event="stats").encode() for r in pending]
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=DroppingStream(chunks))
        return httpx.Response(404, json={"error": {"message": "no", "type": "x", "code": None}})

    return handler, seen_headers


def test_iter_stats_reconnects_with_last_event_id_without_gap():
    handler, seen = _server(drop_after=3)
    with StatsClient("http://kvfleet", transport=httpx.MockTransport(handler)) as c:
        it = c.iter_stats(since=-1, retry_delay_s=0)
        got = [next(it)["iter"] for _ in range(10)]
    assert got == list(range(10))
    assert seen[:5] == [None, "2", "4", "6", "8"]


@pytest.mark.parametrize("new_records", [3, 8], ids=["fewer", "more"])
def test_iter_stats_follows_a_fresh_app_from_its_oldest_record(new_records):
    """After a reconnect to a fresh app (iterations from 0 again, other timestamps) the client starts over at
    its oldest record; it waited for iter > the old app's last, dropping the new app's records."""
    apps = [[{"iter": i, "timestamp": f"old-{i}"} for i in range(5)],
            [{"iter": i, "timestamp": f"new-{i}"} for i in range(new_records)]]

    def handler(request: httpx.Request) -> httpx.Response:
        records = apps[0]
        since = int(request.url.params.get("since", -1))
        if request.url.path == "/stats":
            return httpx.Response(200, json=[r for r in records if r["iter"] > since][:1])
        start = int(request.headers.get("last-event-id", since))
        events = [format_event(json.dumps(r), id=r["iter"], event="stats").encode() for r in records
                  if r["iter"] > start]
        if len(apps) > 1:
            apps.pop(0)  # this connection breaks, and the next one reaches the new app
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=DroppingStream(events))

    with StatsClient("http://kvfleet", transport=httpx.MockTransport(handler)) as c:
        it = c.iter_stats(retry_delay_s=0)
        got = [next(it)["timestamp"] for _ in range(5 + new_records)]
    assert got == [f"old-{i}" for i in range(5)] + [f"new-{i}" for i in range(new_records)]


def test_iter_stats_gives_up_after_max_retries():
    handler, _ = _server(drop_after=0)  # every connection breaks before a record
    with StatsClient("http://kvfleet", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(httpx.ReadError):
            list(c.iter_stats(max_retries=2, retry_delay_s=0))


def test_get_stats_paging_and_errors():
    handler, _ = _server(drop_after=1)
    with StatsClient("http://kvfleet", transport=httpx.MockTransport(handler)) as c:
        assert c.get_stats(since=7) == RECORDS[8:]
        assert c.get_stats() == RECORDS[:4]  # one page
        assert c.get_all_stats(page=3) == RECORDS
        assert c.get_all_stats(since=2) == RECORDS[3:]
        assert c.latest_iter() == 9
        with pytest.raises(StatsError) as exc:
            c.rank(9)
    assert exc.value.status == 404 and exc.value.code == "unknown_rank" and "unknown rank 9" in str(exc.value)
