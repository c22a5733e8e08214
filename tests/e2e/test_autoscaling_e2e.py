"""Autoscaling on Ray: the `kv` policy grows the fleet of simulated engine replicas under streaming load and
shrinks it when the load is gone; every stream completes whole (a replica stopped mid-stream hands its requests
back, re-sent with the tokens so far), the engines that leave stay readable as gone, and nothing of theirs is
left running in the cluster."""

import itertools
import threading
import time

import httpx
import pytest

from deployment.clients.client import StatsClient
from tests.support.e2e_fixtures import engine_records, module_app, summed_counters

pytestmark = pytest.mark.slow

BASE = "scale2e"
SETTINGS = {"model": "simulated", "engine_id": BASE, "engine_replicas": "1", "engine_replicas_min": "1",
            "engine_replicas_max": "3", "dp": "1", "tp": "1", "num_cpus_per_rank": "0.1", "max_seq_len": "2048",
            "host_cache_bytes": "0", "max_num_seqs": "2", "simulated_speedup_ratio": "0.05",
            "autoscale_upscale_delay_s": "1", "autoscale_downscale_delay_s": "4", "autoscale_look_back_s": "2",
            "autoscale_metrics_interval_s": "0.5", "gone_engine_retention_s": "600"}
DEADLINE_S = 240
TOKENS = 48

app = module_app("kvfleet-autoscaling", SETTINGS, "/scale")


def _stream(app: str, i: int, out: dict) -> None:
    """One streamed completion; its text and whether it ended with [DONE]."""
    body = {"prompt": f"tenant {i % 3}: " + "the shared part of a long prompt " * 8 + f"question {i}",
            "max_tokens": TOKENS, "ignore_eos": True, "stream": True, "cache_salt": f"tenant-{i}"}
    text, done = [], False
    try:
        with httpx.stream("POST", f"{app}/v1/completions", json=body, timeout=300) as r:
            out[i] = {"status": r.status_code}
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    import json

                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out[i]["error"] = chunk["error"]
                    else:
                        text.append(chunk["choices"][0]["text"])
    except httpx.HTTPError as exc:
        out[i] = {"status": -1, "error": repr(exc)}
    out[i].update(text="".join(text), done=done)


COUNTERS = {"iterAllocTotalBlocks": "allocTotalBlocks",
            "iterReusedBlocks": "reusedBlocks", "iterMissedBlocks": "missedBlocks"}


def _engines(app: str) -> dict[str, dict]:
    return httpx.get(f"{app}/health", timeout=30).json().get("engines", {})


def _records(app: str, engine: str) -> bool:
    return bool(httpx.get(f"{app}/stats", params={"engine": engine, "limit": 1}, timeout=30).json())


def _live(app: str) -> int:
    return sum(not e.get("gone") for e in _engines(app).values())


def _wait(what: str, check, deadline: float):
    while not (got := check()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.5)  # poll interval: Serve's control loop and the replicas' starts
    return got


def test_load_grows_the_fleet_and_its_end_shrinks_it_losing_nothing(app):
    import ray

    deadline = time.monotonic() + DEADLINE_S
    out: dict[int, dict] = {}
    ids = itertools.count()
    streams = {"workers": 6}  # streaming clients in a closed loop: 6 while the fleet grows, then 1

    def client(k: int) -> None:
        while k < streams["workers"] and time.monotonic() < deadline:
            _stream(app, next(ids), out)

    clients = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in clients:
        t.start()
    _wait("three engines", lambda: _live(app) == 3, deadline)
    _wait("a stream served by each engine", lambda: all(_records(app, e) for e in _engines(app)), deadline)
    at_peak = len(out)  # streams started so far (a stream takes seconds here, so their number depends on timing)
    # one client from here: the load falls, and the fleet shrinks under its streams (each scale-down drains or
    # hands back a replica's requests) until one engine is left
    streams["workers"] = 1
    _wait("a scale-down to one engine", lambda: _live(app) == 1, deadline)
    streams["workers"] = 0
    for t in clients:
        t.join(timeout=DEADLINE_S)
    # every stream whole: all its tokens, [DONE], no error (a stopped replica's requests were re-sent)
    bad = {i: r for i, r in out.items() if r.get("status") != 200 or not r.get("done") or r.get("error")}
    assert not bad and len(out) > at_peak, bad  # and streams kept coming while the fleet shrank
    assert all(len(r["text"]) == TOKENS for r in out.values())

    engines = _engines(app)
    gone = sorted(eid for eid, e in engines.items() if e.get("gone"))
    assert gone and all(not engines[eid]["up"] for eid in gone)
    with StatsClient(app) as c:
        kv = c.kv_cache_stats()
        assert set(gone) <= set(kv["gone"]) and set(gone) <= set(kv["engines"])
        # the conservation law, per engine (gone ones included, from their records still readable) and for the
        # fleet: each engine's iteration counters sum to its cumulative stats, and the fleet's to their sum
        per = kv["engines"]
        served = {eid: engine_records(c, eid) for eid in per}
        assert any(served[eid] for eid in gone), "no gone engine served a stream"
        for eid, records in served.items():
            summed = summed_counters(records, COUNTERS)
            assert summed == {k: per[eid].get(k, 0) for k in summed}, eid
        for k in COUNTERS.values():
            assert kv["fleet"][k] == sum(per[e].get(k, 0) for e in per), k
    text = httpx.get(f"{app}/metrics", timeout=30).text
    for eid in gone:
        assert f'engine="{eid}"' not in text  # a gone engine's series stop

    # nothing of a gone engine is left: its ranks, their placement groups and, after a grace, its aggregator
    # (Ray's GCS tables; the state API needs the dashboard, which the test cluster runs without)
    def leftovers() -> list[str]:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        names += [p.get("name") or "" for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]
        return [n for n in names for eid in gone
                if n == f"kvfleet-stats-{eid}" or n.startswith((f"kvfleet-rank-{eid}-", f"kvfleet-{eid}-dp"))]

    _wait("the gone engines' actors removed", lambda: not leftovers() or None, deadline)
