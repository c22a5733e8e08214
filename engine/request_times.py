"""The engine's record of each request's moments, for vLLM's request metrics (aggregator/request_stats.py).

vLLM stamps a request when it is queued, first scheduled, produces each token and finishes; so does the engine
here, on the request itself (`RequestTimes`, O(1) per event), and `RequestRecorder` gathers one iteration's
figures per dp group for the aggregator: time to first token and each inter-token latency as they happen, the
phase times of every request that finished, the prompt tokens by source once a prefill completes, and the
prefix lookups (tokens queried, found on the primary tier, found on the host tier) at first admission.
Times are the engine's monotonic clock; arrival is when the engine admitted the request.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aggregator.request_stats import PROMPT_COUNTERS, FinishedRequest, RequestFigures, prompt_counts


class ArrivalRate:
    """Tokens arriving a second over the last `window_s` (the autoscaling load report's demand): what is older
    leaves on every call, so it holds one window's arrivals whether or not anyone reads it (a fixed fleet never
    does)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._arrivals: deque[tuple[float, int]] = deque()  # (time, tokens), oldest first
        self._tokens = 0  # their sum

    def add(self, tokens: int, now: float) -> None:
        self._arrivals.append((now, tokens))
        self._tokens += tokens
        self._expire(now)

    def per_s(self, now: float) -> float:
        self._expire(now)
        return self._tokens / self.window_s

    def __len__(self) -> int:
        return len(self._arrivals)

    def _expire(self, now: float) -> None:
        since = now - self.window_s
        while self._arrivals and self._arrivals[0][0] < since:
            self._tokens -= self._arrivals.popleft()[1]


@dataclass(slots=True)
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    queued: float = field(default_factory=time.monotonic)  # waiting for a group since: arrival, or its re-queue
    scheduled: float = 0.0  # first admitted to a group: the end of its queue time
    first_token: float = 0.0
    last_token: float = 0.0
    tokens: int = 0
    looked_up: bool = False  # its first admission's prefix lookup is counted
    local: int = 0  # prompt tokens its first admission found on the primary tier
    external: int = 0  # ... on the host tier
    finished: bool = False


class RequestRecorder:
    """One iteration's request figures, per dp group, until `take`."""

    def __init__(self, model_name: str, max_model_len: int, dp: int) -> None:
        self.model_name, self.max_model_len, self.dp = model_name, max_model_len, dp
        self.now = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        n = self.dp
        self.preempted, self.generated, self.prompt_done = [0] * n, [0] * n, [0] * n
        self.queries, self.local_hits, self.host_hits = [0] * n, [0] * n, [0] * n
        self.ran = [False] * n
        self.prompt = [dict.fromkeys(PROMPT_COUNTERS, 0) for _ in range(n)]
        self.ttft: list[tuple[int, float]] = []
        self.itl: list[tuple[int, float]] = []
        self.finished: list[FinishedRequest] = []

    def step(self, dp: int, res: Any, requests: dict) -> None:
        """A group's step result (tp rank 0's), before its tokens are applied: its new requests' prefix
        lookups (first admission only, as vLLM counts new requests and not preempted ones) and preemptions."""
        self.now = time.monotonic()
        self.ran[dp] = bool(res.ran)
        self.preempted[dp] += len(res.recomputed) + len(res.suspended)
        for rid, reused in res.reused.items():
            req = requests.get(rid)
            if req is None or req.times.looked_up:
                continue
            t = req.times
            t.looked_up, t.external = True, res.reused_host.get(rid, 0)
            t.local = reused - t.external
            self.queries[dp] += len(req.prompt)
            self.local_hits[dp] += t.local
            self.host_hits[dp] += t.external

    def event(self, req: Any, finish_reason: str | None, failed: bool) -> None:
        """A token delivered to `req` (or its failure): first token, inter-token latency, finish."""
        t, dp = req.times, max(req.dp, 0)
        if not failed:
            t.tokens += 1
            self.generated[dp] += 1
            if not t.first_token:
                t.first_token = self.now
                self.ttft.append((dp, self.now - t.arrival))
                counts = prompt_counts(len(req.prompt), t.local, t.external)
                for k, v in counts.items():
                    self.prompt[dp][k] += v
                self.prompt_done[dp] += len(req.prompt)
            else:
                self.itl.append((dp, self.now - t.last_token))
            t.last_token = self.now
        if failed or finish_reason is not None:
            self.finish(req, "error" if failed else finish_reason)

    def finish(self, req: Any, reason: str, now: float | None = None) -> None:
        """The request is done (stop, length, abort, error): its FinishedRequest, once."""
        t = req.times
        if t.finished:
            return
        t.finished = True
        now = self.now if now is None else now
        timing: dict[str, float | None] = {}
        if t.scheduled:
            timing["queue_s"] = t.scheduled - t.arrival
            if t.first_token:
                decode = t.last_token - t.first_token
                timing.update(prefill_s=t.first_token - t.scheduled, decode_s=decode,
                              inference_s=t.last_token - t.scheduled,
                              tpot_s=decode / (t.tokens - 1) if t.tokens > 1 else 0.0)
        self.finished.append(FinishedRequest(
            max(req.dp, 0), reason, len(req.prompt), t.tokens, req.max_tokens,
            len(req.prompt) - t.local - t.external, now - t.arrival, **timing))

    def take(self, groups: list) -> RequestFigures:
        """This iteration's figures (the groups' queues as they are now), and start the next."""
        out = RequestFigures(
            self.model_name, self.max_model_len, [len(g.running) for g in groups], [len(g.waiting) for g in groups],
            self.preempted, self.generated, self.queries, self.local_hits, self.host_hits,
            [p + g if ran else -1 for p, g, ran in zip(self.prompt_done, self.generated, self.ran, strict=True)],
            self.prompt, self.ttft, self.itl, self.finished)
        self._reset()
        return out
