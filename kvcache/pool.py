"""Pages and slot pools: where one tier of one pool group keeps its blocks.

A `Page` is one stored token block of one life cycle (the KV of all its layers); it lives in a slot of a
`SlotPool`, moves between tiers by a real tensor copy, and is shared by every request and tree node that
points at it. A pool keeps three O(1) sets so that gauges never need a scan: the free slots, the evictable
pages (published, held by nobody; LRU per priority) and, on the primary tier, the suspended pages (held
only by inactive requests, so they may be offloaded).
"""

import torch

from kvcache.residency import now

DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority; lower is evicted first


class Page:
    __slots__ = ("lc", "tier", "slot", "ref", "active_ref", "node", "priority", "born", "touched", "idle")

    def __init__(self, lc: int, tier: int, slot: int, priority: int = DEFAULT_PRIORITY, held: bool = False) -> None:
        self.lc = lc  # life cycle id
        self.tier = tier
        self.slot = slot
        self.ref = self.active_ref = int(held)  # held: a fresh page of the active request that allocated it
        # ref: requests holding the page; active_ref: of those, the active (resumed) ones
        self.node = None  # the reuse-tree node that publishes it, if any
        self.priority = priority
        # residency (kvcache/residency.py): allocated on the primary tier, last accessed, last released
        self.born = self.touched = self.idle = now()


class SlotPool:
    __slots__ = ("tensor", "num_slots", "free", "evictable", "num_evictable", "suspended", "peak_free",
                 "peak_used", "peak_evictable")

    def __init__(self, num_slots: int, slot_bytes: int, device: str, pin: bool = False) -> None:
        self.num_slots = num_slots
        self.tensor = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, device=device, pin_memory=pin)
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.evictable: dict[int, dict[Page, None]] = {}  # priority -> insertion-ordered LRU
        self.num_evictable = 0
        self.suspended: dict[Page, None] = {}
        self.reseed_peaks()

    def add_evictable(self, page: Page) -> None:
        lru = self.evictable.get(page.priority)
        if lru is None:
            lru = self.evictable[page.priority] = {}
        lru[page] = None
        self.num_evictable += 1

    def remove_evictable(self, page: Page) -> None:
        del self.evictable[page.priority][page]
        self.num_evictable -= 1

    def pop_evictable(self) -> Page:
        """The least recently released page of the lowest priority."""
        for prio in sorted(self.evictable):
            lru = self.evictable[prio]
            if lru:
                page = next(iter(lru))
                del lru[page]
                self.num_evictable -= 1
                return page
        raise LookupError("no evictable page")

    def sample_peaks(self) -> None:
        ev = self.num_evictable
        free = len(self.free) + ev
        if free > self.peak_free:
            self.peak_free = free
        if self.num_slots - free > self.peak_used:
            self.peak_used = self.num_slots - free
        if ev > self.peak_evictable:
            self.peak_evictable = ev

    def drain_gauges(self) -> tuple[int, ...]:
        """(max, free, used, evictable, peak free, peak used, peak evictable); peaks re-seeded from now."""
        ev = self.num_evictable
        free = len(self.free) + ev
        used = self.num_slots - free
        out = (self.num_slots, free, used, ev, self.peak_free, self.peak_used, self.peak_evictable)
        self.peak_free, self.peak_used, self.peak_evictable = free, used, ev
        return out

    def reseed_peaks(self) -> None:
        _, self.peak_free, self.peak_used, self.peak_evictable = self.gauges()

    def gauges(self) -> tuple[int, int, int, int]:
        """(max, free incl. evictable, used, evictable)."""
        free = len(self.free) + self.num_evictable
        return self.num_slots, free, self.num_slots - free, self.num_evictable
