"""KV block residency on the primary tier, for every block (vLLM only samples it), and tier-copy times.

vLLM's three residency histograms, with its bucket edges: a block's lifetime (allocated on the primary tier
-> evicted from it), its idle time before eviction (last released by a request -> evicted) and the gap
between two consecutive accesses (allocation or a reuse hit -> the next hit). Only published blocks that
nobody holds are evicted (offloaded to the host tier or dropped), as only vLLM's cached blocks are; a block
freed unpublished is not an eviction. Each event costs O(1) on the block touched: three timestamps live on
the `Page`, and the histograms are plain counts per bucket that a drain hands over with the iteration.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass

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


def now() -> float:
    return time.monotonic()


class Residency:
    """The residency events of one manager until the next `drain`."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._counts = [[0] * (len(RESIDENCY_BUCKETS) + 1) for _ in RESIDENCY_KINDS]
        self._sums = [0.0] * len(RESIDENCY_KINDS)
        self._any = False
        self.onboard_s = self.offload_s = 0.0

    def _observe(self, kind: int, seconds: float) -> None:
        self._counts[kind][bisect_left(RESIDENCY_BUCKETS, seconds)] += 1  # le is inclusive
        self._sums[kind] += seconds
        self._any = True

    def hit(self, page, t: float) -> None:
        """A request reuses the block: one reuse gap since its last access."""
        self._observe(REUSE_GAP, t - page.touched)
        page.touched = t

    def evicted(self, page, t: float) -> None:
        """The unheld published block leaves the primary tier (offloaded or dropped)."""
        self._observe(LIFETIME, t - page.born)
        self._observe(IDLE_BEFORE_EVICT, t - page.idle)

    def copied(self, to_tier: int, from_tier: int, t: float) -> None:
        """A block copy that began at t is done: host -> primary is an onboard, primary -> host an offload
        (copies are synchronous, so their wall time is theirs); a copy within the primary tier is neither."""
        if from_tier and not to_tier:
            self.onboard_s += now() - t
        elif to_tier and not from_tier:
            self.offload_s += now() - t

    def drain(self) -> BlockStats | None:
        """This iteration's counts and copy times (None when nothing happened), and start over."""
        if not self._any and not self.onboard_s and not self.offload_s:
            return None
        out = BlockStats(tuple(tuple(c) for c in self._counts), tuple(self._sums), self.onboard_s, self.offload_s)
        self._reset()
        return out
