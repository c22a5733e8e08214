"""KV block residency on the primary tier, for every block (vLLM only samples it), and tier-copy times.

vLLM's three residency histograms, with its bucket edges: a block's lifetime (allocated on the primary tier
-> evicted from it), its idle time before eviction (last released by a request -> evicted) and the gap
between two consecutive accesses (allocation or a reuse hit -> the next hit). Only published blocks that
nobody holds are evicted (offloaded to the host tier or dropped), as only vLLM's cached blocks are; a block
freed unpublished is not an eviction. Each event costs O(1) on the block touched: three timestamps live on
the `Page`; the events' seconds are bucketed when a drain hands the counts over with the iteration. Only the
stats path drains, so the manager records events only while statistics are on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

# vLLM's kv_cache_residency_buckets (seconds)
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
                     600, 1200, 1800)
LIFETIME, IDLE_BEFORE_EVICT, REUSE_GAP = range(3)
RESIDENCY_KINDS = ("lifetime", "idle_before_evict", "reuse_gap")


@dataclass(frozen=True, slots=True)
class BlockStats:
    """One rank's iteration: per residency kind, counts per bucket of RESIDENCY_BUCKETS then +Inf (not
    cumulative) and the sum of the observed seconds; the seconds its host-tier copies took each way."""

    counts: tuple[tuple[int, ...], ...]
    sums: tuple[float, ...]
    onboard_s: float = 0.0
    offload_s: float = 0.0


now = time.monotonic  # the clock of every residency stamp (an alias, not a wrapper: it runs per block touched)


class Residency:
    """The residency events of one manager until the next `drain`. An event only appends its seconds (it runs
    per block touched, in the step); the drain buckets them all at once (kvcache_bench measures the cost)."""

    def __init__(self) -> None:
        self._seconds: tuple[list[float], ...] = ([], [], [])  # per RESIDENCY_KINDS
        self.onboard_s = self.offload_s = 0.0

    def hit(self, page, t: float) -> None:
        """A request reuses the block: one reuse gap since its last access."""
        self._seconds[REUSE_GAP].append(t - page.touched)
        page.touched = t

    def evicted(self, page, t: float) -> None:
        """The unheld published block leaves the primary tier (offloaded or dropped)."""
        self._seconds[LIFETIME].append(t - page.born)
        self._seconds[IDLE_BEFORE_EVICT].append(t - page.idle)

    def copied(self, to_tier: int, from_tier: int, t: float) -> None:
        """A block copy that began at t is done: host -> primary is an onboard, primary -> host an offload
        (copies are synchronous, so their wall time is theirs); a copy within the primary tier is neither."""
        if from_tier and not to_tier:
            self.onboard_s += now() - t
        elif to_tier and not from_tier:
            self.offload_s += now() - t

    def drain(self) -> BlockStats | None:
        """This iteration's counts and copy times (None when nothing happened), and start over."""
        if not any(self._seconds) and not self.onboard_s and not self.offload_s:
            return None
        edges = np.asarray(RESIDENCY_BUCKETS)
        counts, sums = [], []
        for seconds in self._seconds:
            x = np.asarray(seconds, dtype=np.float64)
            # le is inclusive: searchsorted's left side puts a value equal to an edge in that edge's bucket
            counts.append(tuple(np.bincount(np.searchsorted(edges, x, side="left"), minlength=len(edges) + 1)
                                .tolist()))
            sums.append(float(x.sum()))
            seconds.clear()
        out = BlockStats(tuple(counts), tuple(sums), self.onboard_s, self.offload_s)
        self.onboard_s = self.offload_s = 0.0
        return out
