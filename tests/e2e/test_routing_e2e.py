"""KV routing through the Serve app: cache_salt, the records' routing field, /metrics and /kv_events."""

import json
import time

import httpx
import pytest

from deployment.clients.client import StatsClient
from deployment.ingress.sse import SSEDecoder
from engine.routing_record import salt_label
from kvcache.events import prompt_keys

pytestmark = pytest.mark.slow

B = 16  # the app's tokens_per_block
PROMPT_A = [(5 * i) % 200 + 20 for i in range(80)]  # 5 full blocks
PROMPT_B = [(7 * i) % 200 + 21 for i in range(48)]


def _complete(http: httpx.Client, prompt: list[int], salt: str) -> None:
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": salt})
    assert r.status_code == 200, r.text


def _kv_events(http: httpx.Client, headers: dict, until) -> list[tuple[str, dict]]:
    """Events from /kv_events until `until(events)` holds."""
    out, dec = [], SSEDecoder()
    with http.stream("GET", "/kv_events", headers=headers) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            ev = dec.feed(line)
            if ev is not None:
                assert ev.event == "kv_event"
                out.append((ev.id, json.loads(ev.data)))
                if until(out):
                    return out
    raise AssertionError("the stream ended")


def _routing_sums(http: httpx.Client, salt: str, want: int, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        routing = [r["routing"] for r in StatsClient(str(http.base_url)).get_all_stats() if r.get("routing")]
        mine = [r["perSalt"][salt_label(salt)] for r in routing if salt_label(salt) in r["perSalt"]]
        if sum(s["requests"] for s in mine) >= want or time.monotonic() > deadline:
            return {k: sum(s[k] for s in mine) for k in ("requests", "predictedReusedBlocks",
                                                          "realizedReusedBlocks")} | {"records": routing}
        time.sleep(0.2)  # poll interval while the mirror catches up


def test_salted_requests_follow_their_prefix_and_the_stream_shows_their_blocks(serve_app):
    with httpx.Client(base_url=serve_app, timeout=60) as http:
        _complete(http, PROMPT_A, "e2e-tenant-a")
        _complete(http, PROMPT_A + [9], "e2e-tenant-a")
        sums = _routing_sums(http, "e2e-tenant-a", 2)
        assert sums["requests"] == 2
        assert sums["predictedReusedBlocks"] > 0 and sums["realizedReusedBlocks"] == sums["predictedReusedBlocks"]
        for rec in sums["records"]:  # the per-salt entries sum to the record's figures
            assert rec["policy"] == "kv"
            assert sum(s["requests"] for s in rec["perSalt"].values()) == rec["requests"] == sum(
                rec["perGroupRequests"])
        metrics = http.get("/metrics").text
        assert "kvfleet_routing_requests_total" in metrics and "kvfleet_routing_group_requests_total" in metrics

        keys_a = prompt_keys(PROMPT_A, B, "e2e-tenant-a")
        # a new client starts from the engine's index: tenant a's blocks are in one group's BlockStored
        snap = _kv_events(http, {}, lambda evs: any(set(keys_a) <= set(e.get("block_hashes", ())) for _, e in evs))
        assert snap[0][1]["resync"] and {e["dp_rank"] for _, e in snap} <= {0, 1}
        last = snap[-1][0]

        _complete(http, PROMPT_B, "e2e-tenant-b")
        first_b = prompt_keys(PROMPT_B, B, "e2e-tenant-b")[0]
        live = _kv_events(http, {"Last-Event-ID": last},
                          lambda evs: any(first_b in e.get("block_hashes", ()) for _, e in evs))
        incarnation, _, seq = last.partition("-")  # ids are <incarnation>-<seq>
        assert [i for i, _ in live] == [f"{incarnation}-{n}" for n in range(int(seq) + 1, int(seq) + 1 + len(live))], \
            "a gap or a repeat"
        stored = next(e for _, e in live if first_b in e.get("block_hashes", ()))
        assert stored["type"] == "BlockStored" and stored["medium"] == "GPU" and stored["block_size"] == B
        assert stored["token_ids"] == [] and stored["parent_block_hash"] is None  # a salted prompt stays in
        assert not set(keys_a) & set(prompt_keys(PROMPT_A, B, "e2e-tenant-b"))  # salts never share a key
