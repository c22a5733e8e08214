"""One request's pending statistics: what it allocated and reused since its last stats commit (SPEC 3).

Allocations are kept per life cycle as block-ordinal segments `[start, end, kind]`, so a shrink before the
commit rolls back exactly the overlapped part, newest segment first, and an allocation reverted before the
commit leaves no trace. Every call costs O(segments touched); a commit walks only what is pending.
"""

from kvcache.stats import (
    ALLOC_NEW,
    ALLOC_TOTAL,
    FULL_REUSED,
    GEN_ALLOC,
    MISSED,
    PARTIAL_REUSED,
    REUSED,
    KVCacheStatsDelta,
)

# what an allocated segment counts as besides an allocation
SEG_MISS, SEG_GEN, SEG_PLAIN = 0, 1, 2


class PendingStats:
    __slots__ = ("segments", "reuse", "any", "any_reuse")

    def __init__(self, num_life_cycles: int) -> None:
        self.segments: list[list[list[int]]] = [[] for _ in range(num_life_cycles)]
        self.reuse = [[0, 0] for _ in range(num_life_cycles)]  # (full, partial) reused blocks per life cycle
        self.any = False  # anything to commit: lets most decode steps skip the walk
        self.any_reuse = False  # the reuse match is counted once, at the first commit

    def add_reuse(self, lc: int, full: int, partial: int) -> None:
        r = self.reuse[lc]
        r[0] += full
        r[1] += partial
        self.any = self.any_reuse = True

    def add(self, start: int, end: int, kind: int, only: int | None = None) -> None:
        """Blocks `[start, end)` of every life cycle (or of life cycle `only`) were allocated."""
        for segs in self.segments if only is None else (self.segments[only],):
            if segs and segs[-1][1] == start and segs[-1][2] == kind:
                segs[-1][1] = end
            else:
                segs.append([start, end, kind])
        self.any = True

    def rollback(self, end: int) -> None:
        """Capacity shrank to `end` blocks: forget every pending allocation at or past it."""
        for segs in self.segments:
            while segs and segs[-1][1] > end:
                seg = segs[-1]
                seg[1] = max(seg[0], end)
                if seg[1] == seg[0]:
                    segs.pop()

    def commit(self, counters: list[list[int]], totals: list[int]) -> KVCacheStatsDelta:
        """Add everything pending to the per-life-cycle counters and the manager totals `[alloc_total,
        alloc_new, reused, missed]`, empty it, and return the request's delta."""
        alloc = missed = reused = 0
        for lc, segs in enumerate(self.segments):
            if segs:
                c = counters[lc]
                for start, end, kind in segs:
                    n = end - start
                    alloc += n
                    c[ALLOC_TOTAL] += n
                    c[ALLOC_NEW] += n
                    if kind == SEG_MISS:
                        c[MISSED] += n
                        missed += n
                    elif kind == SEG_GEN:
                        c[GEN_ALLOC] += n
                segs.clear()
        if self.any_reuse:
            for lc, r in enumerate(self.reuse):
                c = counters[lc]
                c[FULL_REUSED] += r[0]
                c[PARTIAL_REUSED] += r[1]
                c[REUSED] += r[0] + r[1]
                reused += r[0] + r[1]
                r[0] = r[1] = 0
            self.any_reuse = False
        self.any = False
        totals[0] += alloc
        totals[1] += alloc
        totals[2] += reused
        totals[3] += missed
        return KVCacheStatsDelta(alloc, alloc, reused, missed)

    def discard(self) -> None:
        """Forget everything pending (a closed request's stats never reach the manager)."""
        for segs in self.segments:
            segs.clear()
        for r in self.reuse:
            r[0] = r[1] = 0
        self.any = self.any_reuse = False
