"""A small Python client for kvfleet's statistics, the counterpart of TensorRT-LLM's `LLM.get_stats()`.

    from deployment.clients.client import StatsClient
    with StatsClient("http://127.0.0.1:8000") as c:
        records = c.get_stats(since=-1)          # a page of cluster records with iter > since, oldest first
        everything = c.get_all_stats()           # every buffered record, page after page
        for record in c.iter_stats():            # follows /stats/stream; reconnects with Last-Event-ID
            ...                                  # (with several engines: every engine's, the vector cursor)
        c.kv_cache_stats()                       # the cluster's cumulative kvCacheStats

    from deployment.clients.client import stream_completion
    stream_completion("http://127.0.0.1:8000", {"prompt": "Hi", "max_tokens": 16}).text  # resumes a cut stream

Server errors arrive in OpenAI's shape and are raised as `StatsError` with the server's message.
"""

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from deployment.ingress.sse import SSEDecoder

logger = logging.getLogger("kvfleet.deployment")


class StatsError(Exception):
    """The server refused a request (4xx/5xx); `status`, `code` and the server's message."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.code = code


def _raise_for_error(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        err = resp.json()["error"]
        message, code = err.get("message", resp.text), err.get("code")
    except Exception:
        message, code = resp.text, None
    raise StatsError(resp.status_code, message, code)


class StatsClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport)

    def __enter__(self) -> "StatsClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _get(self, path: str, **params: Any) -> Any:
        resp = self._http.get(path, params={k: v for k, v in params.items() if v is not None})
        _raise_for_error(resp)
        return resp.json()

    def get_stats(self, since: int | str = -1, limit: int | None = None, ranks: bool = False,
                  engine: str | None = None) -> list[dict]:
        """One page of cluster records with `iter > since`, oldest first (`limit` records, the server's
        default page when None). With several engines `since` is the vector `<engine>:<iter>,...` (or -1),
        or `engine` names one. Reading removes nothing."""
        return self._get("/stats", since=since, limit=limit, ranks=str(ranks).lower(), engine=engine)

    def get_all_stats(self, since: int = -1, page: int = 1000) -> list[dict]:
        """Every buffered record after `since`: pages of `page` records, following each one's `rel="next"`."""
        out: list[dict] = []
        resp = self._http.get("/stats", params={"since": since, "limit": page})
        while True:
            _raise_for_error(resp)
            out.extend(resp.json())
            if "next" not in resp.links:
                return out
            resp = self._http.get(resp.links["next"]["url"])

    def latest_iter(self) -> int:
        """The newest buffered iteration, or -1 when there is none."""
        records = self.get_all_stats()
        return records[-1]["iter"] if records else -1

    def same_history(self, record: dict, engine: str | None = None) -> bool:
        """Whether the server still holds `record` as it was (same iter, same timestamp). A fresh app (a new
        cluster, its aggregator numbering from 0 again) does not, so resuming after the record's iteration
        would drop the new app's records until its numbering passed the old one. The dashboard's rule.
        `engine`: the engine of the record, asked of that engine alone (several engines)."""
        got = self.get_stats(since=record["iter"] - 1, limit=1, engine=engine)
        return bool(got) and got[0]["iter"] == record["iter"] and got[0].get("timestamp") == record.get("timestamp")

    def kv_cache_stats(self) -> dict:
        return self._get("/kv_cache_stats")

    def reuse_counts(self) -> tuple[int, int]:
        """(reused, missed) blocks so far, of the fleet (or of the one engine): a hit rate over a run is the
        difference of two of these."""
        stats = self.kv_cache_stats()
        s = stats.get("fleet", stats)
        return s["reusedBlocks"], s["missedBlocks"]

    def routing_summary(self) -> tuple[dict[str, int], tuple[int, int]]:
        """Requests each engine admitted, and (predicted, realized) reuse of the requests placed by the last level
        of routing (the fleet's router when it placed them, else the engine's), over every record held."""
        out: dict[str, int] = {}
        predicted = realized = 0
        for r in self.get_all_stats():
            out[r["engineId"]] = out.get(r["engineId"], 0) + r.get("numNewActiveRequests", 0)
            routing = r.get("routing") or {}
            level = routing.get("fleet") if (routing.get("fleet") or {}).get("requests") else routing
            predicted += level.get("predictedReusedBlocks", 0)
            realized += level.get("realizedReusedBlocks", 0)
        return dict(sorted(out.items())), (predicted, realized)

    def ranks(self) -> dict:
        return self._get("/stats/ranks")

    def rank(self, rank: int) -> dict:
        return self._get(f"/stats/ranks/{rank}")

    def health(self) -> dict:
        return self._get("/health")

    def iter_stats(self, since: int = -1, reconnect: bool = True, max_retries: int = 10,
                   retry_delay_s: float = 0.5, read_timeout_s: float = 60.0) -> Iterator[dict]:
        """Follow /stats/stream forever, yielding records in order without gaps or repeats.

        A dropped connection is reopened with `Last-Event-ID` = the last iteration received, so the
        server resumes right after it (as long as it still buffers those records). A server with another
        history (a fresh app numbering from 0 again, see `same_history`) is followed from its oldest record.
        With several engines the ids are vectors (`<engine>:<iter>,...`): the client keeps each engine's
        last iteration, resumes with the vector, and resyncs only an engine whose history changed.
        Gives up after `max_retries` consecutive failed connections.
        """
        pos: dict[str, int] = {}  # several engines: each one's last iteration received
        seen: dict[str | None, dict] = {}  # the last record received (per engine with several)
        last, failures = since, 0
        timeout = httpx.Timeout(self._http.timeout.connect, read=read_timeout_s)
        while True:
            headers = {"Accept": "text/event-stream"}
            try:
                for eid, record in list(seen.items()):
                    if not self.same_history(record, eid):
                        logger.info("the server has another history (a fresh app or aggregator%s): following it "
                                    "from its oldest record", f" of {eid}" if eid else "")
                        del seen[eid]
                        pos.pop(eid or "", None)
                        last = -1 if eid is None else last
                cursor = ",".join(f"{e}:{i}" for e, i in pos.items()) if pos else str(last)
                if cursor != "-1":
                    headers["Last-Event-ID"] = cursor
                with self._http.stream("GET", "/stats/stream", params={"since": -1 if pos else last},
                                       headers=headers, timeout=timeout) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        _raise_for_error(resp)
                    decoder = SSEDecoder()
                    for line in resp.iter_lines():
                        event = decoder.feed(line)
                        if event is None or event.event != "stats":
                            continue
                        failures = 0
                        record = json.loads(event.data)
                        if ":" in (event.id or ""):  # the fleet's merged stream
                            eid = record["engineId"]
                            if record["iter"] <= pos.get(eid, -1):
                                continue
                            pos[eid], seen[eid] = record["iter"], record
                        else:
                            if record["iter"] <= last:
                                continue
                            last, seen[None] = record["iter"], record
                        yield record
            except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
                if not reconnect:
                    raise
                failures += 1
                if failures > max_retries:
                    raise
                logger.info("stats stream dropped (%s); reconnecting after %s", type(exc).__name__, pos or last)
                time.sleep(retry_delay_s * min(failures, 10))  # backoff between reconnects
                continue
            if not reconnect:
                return
            failures += 1
            if failures > max_retries:
                raise StatsError(0, "stats stream keeps closing")
            logger.info("stats stream closed by server; reconnecting after %s", pos or last)


# refusals worth another try, as OpenAI's client retries them (it also retries 409): Serve's proxy answers 500
# when the ingress replica it routed to died before answering, 503 while nothing can serve, 429 when the engine's
# queue is full
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)


@dataclass
class Streamed:
    """A streamed completion read to its end: every chunk once, in order; how many cuts it resumed over and
    how many refusals (or failed connections) before a response it retried."""

    chunks: list[dict] = field(default_factory=list)
    resumed: int = 0
    retried: int = 0

    @property
    def text(self) -> str:
        choices = [c["choices"][0] for c in self.chunks if c.get("choices")]
        return "".join(ch.get("text") or ch.get("delta", {}).get("content") or "" for ch in choices)


class StreamError(StatsError):
    """A streamed completion that failed for good; `streamed`: the chunks that had arrived (none: refused)."""

    def __init__(self, status: int, message: str, code: str | None, streamed: Streamed) -> None:
        super().__init__(status, message, code)
        self.streamed = streamed


def stream_completion(base_url: str, body: dict, path: str = "/v1/completions", give_up_s: float = 120.0,
                      headers: dict[str, str] | None = None, timeout_s: float = 300.0,
                      transport: httpx.BaseTransport | None = None) -> Streamed:
    """A streamed completion (or chat completion, by `path`) read to `[DONE]` through what a server of
    replicas does to a stream: a refusal before any response is retried after its Retry-After (at least
    0.2 s), and a stream cut by the death of the ingress replica carrying it is resumed with `Last-Event-ID`
    (it asks for `stream_options.resumable`; deployment/ingress/resume.py), so the chunks are those of one uncut
    stream. Raises StreamError (with the chunks that had arrived) for any other refusal, an in-band error, a
    malformed chunk, a cut stream that cannot be resumed, or when nothing took the request again within
    `give_up_s` of a failure."""
    options = {**(body.get("stream_options") or {}), "resumable": True}
    out = Streamed()
    try:
        return _read_stream(base_url, {**body, "stream": True, "stream_options": options}, path, give_up_s, headers,
                            timeout_s, transport, out)
    except StreamError:
        raise
    except StatsError as exc:
        raise StreamError(exc.status, exc.message, exc.code, out) from None
    except (ValueError, TypeError, AttributeError, KeyError, httpx.HTTPError) as exc:  # not what a server sends
        raise StreamError(200, f"unreadable stream: {type(exc).__name__}: {exc}", "bad_stream", out) from None


def _seconds(retry_after: str | None) -> float:
    """Retry-After in seconds (an HTTP date, which no kvfleet route sends, counts as 1 s)."""
    try:
        return min(float(retry_after or 0), 60.0)
    except ValueError:
        return 1.0


def _read_stream(base_url: str, body: dict, path: str, give_up_s: float, headers: dict[str, str] | None,
                 timeout_s: float, transport: httpx.BaseTransport | None, out: Streamed) -> Streamed:
    last_id: str | None = None
    failed_at: float | None = None
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport) as http:
        while True:
            sent = dict(headers or {}, **({"Last-Event-ID": last_id} if last_id else {}))
            wait = 0.2
            try:
                with http.stream("POST", path, json=body, headers=sent) as resp:
                    if resp.status_code != 200:
                        resp.read()
                        if resp.status_code not in RETRY_STATUSES:
                            _raise_for_error(resp)
                            raise StatsError(resp.status_code, resp.text[:200])  # a 1xx-3xx other than 200
                        wait = max(wait, _seconds(resp.headers.get("retry-after")))
                    else:
                        decoder = SSEDecoder()
                        for line in resp.iter_lines():
                            event = decoder.feed(line)
                            if event is None:
                                continue
                            if event.data == "[DONE]":
                                return out
                            chunk = json.loads(event.data)
                            if "error" in chunk:  # the server's own failure, reported in the stream
                                err = chunk["error"] if isinstance(chunk["error"], dict) else {}
                                raise StreamError(200, err.get("message", str(chunk["error"])), err.get("code"), out)
                            out.chunks.append(chunk)
                            last_id, failed_at = event.id, None  # no id: a server that cannot resume
            except httpx.TransportError as exc:  # no connection, or the stream cut (RemoteProtocolError)
                logger.info("stream of %s broke (%s) after %d chunks", path, type(exc).__name__, len(out.chunks))
            if out.chunks and last_id is None:
                raise StreamError(200, "the stream was cut and has no event ids: it cannot be resumed",
                                  "not_resumable", out)
            if last_id is not None and failed_at is None:
                out.resumed += 1  # a cut after chunks, counted once however many tries the resume takes
            elif last_id is None:
                out.retried += 1
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > give_up_s:
                raise StatsError(503, f"no replica took the stream again within {give_up_s:g} s")
            time.sleep(wait)  # what the server asked for, or a short pause: the replica is being replaced
