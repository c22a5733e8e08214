"""One rank's KV cache manager (V2): pools per pool group and tier, the reuse tree, eviction, statistics.

Design decisions the spec leaves open, written down here:
- Quotas are split so every life cycle gets the same number of slots (`config.split_quota`).
- A page held by a request is never dropped. Pages held only by suspended (or not yet resumed) requests may
  be offloaded to the host tier when the primary tier needs room; published pages that nobody holds are
  evictable (LRU within a priority, lowest priority first): evicting from primary moves them to the host
  tier when it has room (dropping its own LRU page if needed), else drops them.
- With no host tier, the primary tier is the last tier: dropping from it counts as `iterHostDropped*`.
- A partially reused block's source page is held from `create_kv_cache` until the first `resume()` copies
  it, so it cannot be evicted meanwhile (never a miss). If it was offloaded meanwhile, the copy comes from
  the host tier and counts as an onboard (blocks and bytes; the new slot is the pending allocation).
- Everything an excluded request (`exclude_from_stats=True`) causes, tier moves included, is left out of
  the statistics. With stats disabled, counters stay 0 and gauges still work.
- Peaks are sampled at every stats commit and drain, and only re-computed when a gauge may have changed.
- A salt's reuse-tree root lives only while a block or a live cache is under it (`prune`), and block
  residency is recorded only with stats on (only the stats delta drains it): neither grows with time served.
"""

import logging

import torch

from kvcache.cache import KVCache
from kvcache.config import KVCacheManagerConfig, derive_layout, split_quota
from kvcache.events import EventRecorder
from kvcache.pending import PendingStats
from kvcache.pool import Page, SlotPool
from kvcache.residency import Residency, now
from kvcache.reuse import ReuseTrees
from kvcache.stats import (
    ALLOC_NEW,
    ALLOC_TOTAL,
    COPY,
    COPY_BYTES,
    DROPPED,
    DROPPED_BYTES,
    EMPTY_DELTA,
    NUM_COUNTERS,
    OFFLOAD,
    OFFLOAD_BYTES,
    ONBOARD,
    ONBOARD_BYTES,
    KvCacheIterationReport,
    KvCacheStats,
    KVCacheStatsDelta,
    PoolGroupSnapshot,
)

log = logging.getLogger("kvfleet.kvcache")


class KVCacheManager:
    def __init__(self, config: KVCacheManagerConfig) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.life_cycles, self.pool_groups = derive_layout(config)
        self._lc_of_layer = {layer.layer_id: cycle.id for cycle in self.life_cycles for layer in cycle.layers}
        self.pool_group_of = [cycle.pool_group for cycle in self.life_cycles]  # life cycle id -> pool group id
        self._lc_bytes = [cycle.slot_bytes for cycle in self.life_cycles]
        # the life cycles whose blocks go stale as history grows: the only ones commit() looks at
        self.windowed = [cycle for cycle in self.life_cycles if cycle.attention.can_go_stale]
        self.stats_enabled = config.enable_stats
        pri = split_quota(config.gpu_cache_bytes, self.pool_groups)
        sec = split_quota(config.host_cache_bytes, self.pool_groups)
        if min(pri) < 1:
            need = sum(len(group.life_cycles) * group.slot_bytes for group in self.pool_groups)
            raise ValueError(f"gpu_cache_bytes={config.gpu_cache_bytes} holds no block; at least {need} bytes "
                             "are needed")
        pin = torch.cuda.is_available()
        host = "meta" if config.device == "meta" else "cpu"  # a simulated rank's tiers hold no bytes
        self._primary = [SlotPool(n, group.slot_bytes, config.device)
                         for n, group in zip(pri, self.pool_groups, strict=True)]
        self._secondary = [
            SlotPool(n, group.slot_bytes, host, pin=pin and host == "cpu") if config.host_cache_bytes and n else None
            for n, group in zip(sec, self.pool_groups, strict=True)
        ]
        self._iter = [[0] * NUM_COUNTERS for _ in self.life_cycles]
        self._totals = [0, 0, 0, 0]  # alloc_total, alloc_new, reused, missed
        self._pools = [p for p in self._primary + self._secondary if p is not None]
        self.num_slots = sum(p.num_slots for p in self._pools)  # every tier's: the most blocks held at once
        self._lc_meta = [{"id": c.id, "pool_group": c.pool_group, "window_key": c.window_key, "kind": c.kind}
                         for c in self.life_cycles]
        self._dirty = False  # a gauge may have changed since the peaks were last sampled
        # block residency and tier-copy times, drained with each stats delta: recorded only with stats on, as
        # nothing else drains them (they would grow by a float per block touched)
        self.residency = Residency()
        self.reuse = ReuseTrees(self.life_cycles, self.tokens_per_block, config.enable_partial_reuse)
        # KV events follow the first life cycle that never goes stale (kvcache/events.py); None while off
        self.anchor_lc = next((c.id for c in self.life_cycles if not c.attention.can_go_stale), 0)
        self.kv_events: EventRecorder | None = None
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        log.info("kv cache: %d life cycles, %d pool groups, primary slots %s, host slots %s, device %s",
                 len(self.life_cycles), len(self.pool_groups), pri,
                 [p.num_slots if p else 0 for p in self._secondary], config.device)

    # ---- public API -----------------------------------------------------------------------------------
    def create_kv_cache(self, request_id, input_tokens, expected_prompt_length: int | None = None,
                        cache_salt=None, exclude_from_stats: bool = False,
                        block_keys: list[int] | None = None) -> KVCache:
        """`block_keys`: the prompt's full blocks' keys (`kvcache.events.prompt_keys`), so none is hashed twice."""
        return KVCache(self, request_id, input_tokens, expected_prompt_length, cache_salt, exclude_from_stats,
                       block_keys)

    def set_kv_events(self, on: bool, resync: bool = False) -> None:
        """Record KV events (`self.kv_events.drain()` takes them) from now on, starting with a snapshot of
        the whole tree (also when `resync`), or stop recording."""
        if on and self.kv_events is None:
            self.kv_events, resync = EventRecorder(self.anchor_lc), True
        elif not on:
            self.kv_events = None
        if resync and self.kv_events is not None:
            self.kv_events.snapshot(self.reuse.roots)

    def life_cycle_of_layer(self, layer_id: int) -> int:
        return self._lc_of_layer[layer_id]

    def layer_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Primary-tier K and V of one layer, each `[num_slots, tokens_per_block, num_kv_heads, head_dim]`."""
        views = self._views.get(layer_id)
        if views is None:
            cycle = self.life_cycles[self._lc_of_layer[layer_id]]
            layer = next(la for la in cycle.layers if la.layer_id == layer_id)
            pool = self._primary[cycle.pool_group]
            off = cycle.layer_offsets[layer_id]
            n = self.tokens_per_block * layer.block_layer_bytes
            shape = (pool.num_slots, self.tokens_per_block, layer.num_kv_heads, layer.head_dim)
            k = pool.tensor[:, off:off + n].view(layer.dtype).view(shape)
            v = pool.tensor[:, off + n:off + 2 * n].view(layer.dtype).view(shape)
            views = self._views[layer_id] = (k, v)
        return views

    def get_kv_cache_stats(self) -> KvCacheStats:
        mx = fr = 0
        for pool in self._primary:
            m, f, _, _ = pool.gauges()
            mx += m
            fr += f
        t = self._totals
        return KvCacheStats(mx, fr, mx - fr, self.tokens_per_block, t[0], t[1], t[2], t[3])

    def get_iteration_stats(self) -> KvCacheIterationReport | None:
        """Drain the per-life-cycle counters and snapshot the gauges; peaks are re-seeded from now."""
        if not self.stats_enabled:
            return None
        self._sample_peaks()
        counters = self._iter
        self._iter = [[0] * NUM_COUNTERS for _ in counters]
        groups = []
        for group in self.pool_groups:
            tiers = [(0,) * 7 if pool is None else pool.drain_gauges()
                     for pool in (self._primary[group.id], self._secondary[group.id])]
            groups.append(PoolGroupSnapshot(group.id, group.slot_bytes, list(group.window_keys), tiers[0], tiers[1]))
        return KvCacheIterationReport(self._lc_meta, counters, groups)

    def fits(self, num_tokens: int, chunk_tokens: int | None = None) -> bool:
        """Whether one request of `num_tokens` can ever be held on the primary tier (prefill chunked by
        `chunk_tokens`, which bounds what a sliding window holds at once).

        With partial reuse, a request that matched part of a block holds that block's source page until its
        first resume() has copied it into a private slot: one more slot per life cycle at that moment."""
        chunk = num_tokens if chunk_tokens is None else chunk_tokens
        copy = 1 if self.config.enable_block_reuse and self.config.enable_partial_reuse else 0
        for group, pool in zip(self.pool_groups, self._primary, strict=True):
            need = sum(self.life_cycles[lc].attention.blocks_needed(num_tokens, chunk) + copy
                       for lc in group.life_cycles)
            if need > pool.num_slots:
                return False
        return True

    # ---- verbs of the cache: slots, holds, tier moves (`record`: the request counts in the statistics) ----
    def can_take(self, pg: int, k: int) -> bool:
        """Whether `take(pg, k)` would succeed: free, evictable, or offloadable to the host tier."""
        p = self._primary[pg]
        have = len(p.free) + p.num_evictable
        if have >= k:
            return True
        s = self._secondary[pg]
        return s is not None and have + min(len(p.suspended), len(s.free) + s.num_evictable) >= k

    def take(self, pg: int, k: int, record: bool) -> list[int]:
        """k primary slots of pool group pg, offloading or evicting as needed; the caller checked `can_take`."""
        p = self._primary[pg]
        short = k - len(p.free) - p.num_evictable
        while short > 0:  # offload pages that only suspended requests hold
            page = next(iter(p.suspended))
            del p.suspended[page]
            self._offload(page, record)
            short -= 1
        while len(p.free) < k:
            self._evict_primary(p.pop_evictable(), record)
        self._dirty = True
        return [p.free.pop() for _ in range(k)]

    def hold(self, page: Page) -> None:
        """An inactive request takes a page (a reuse match): it is no longer evictable."""
        if self.stats_enabled:
            self.residency.hit(page, now())
        pg = self.pool_group_of[page.lc]
        if page.ref == 0:
            (self._primary if page.tier == 0 else self._secondary)[pg].remove_evictable(page)
            self._dirty = True
        page.ref += 1
        if page.tier == 0 and page.active_ref == 0:
            self._primary[pg].suspended[page] = None

    def release(self, page: Page, active: bool) -> None:
        """A request lets go of a page: unheld, it becomes evictable if published, else free."""
        page.ref -= 1
        if active:
            page.active_ref -= 1
        pg = self.pool_group_of[page.lc]
        if page.tier == 0:
            pool = self._primary[pg]
            if page.ref:
                if not page.active_ref:
                    pool.suspended[page] = None
                return
            pool.suspended.pop(page, None)
        else:
            pool = self._secondary[pg]
            if page.ref:
                return
        page.idle = now()
        if page.node is not None:
            pool.add_evictable(page)
        else:
            pool.free.append(page.slot)
        self._dirty = True

    def lock(self, pages: list) -> None:
        """A request becomes active: its pages may not be offloaded while any active holder lives."""
        for page in pages:
            if page is not None:
                page.active_ref += 1
                if page.active_ref == 1 and page.tier == 0:
                    self._primary[self.pool_group_of[page.lc]].suspended.pop(page, None)

    def unlock(self, pages: list) -> None:
        """Undo `lock` (a suspend): pages held only by inactive requests may be offloaded."""
        for page in pages:
            if page is not None:
                page.active_ref -= 1
                if page.active_ref == 0 and page.tier == 0:
                    self._primary[self.pool_group_of[page.lc]].suspended[page] = None

    def onboard(self, page: Page, slot: int, record: bool) -> None:
        """Bring a host-tier page back into primary slot `slot` (from `take`); an onboard is an allocation."""
        self._move(page, 0, slot)
        if record:
            self._record_onboard(page.lc)

    def copy_partial(self, src: Page, slot: int, priority: int, record: bool) -> Page:
        """A private primary copy, in `slot`, of a shared partially reused page, which is released.

        From the primary tier it is an intra-device copy, and the slot is the caller's pending allocation;
        from the host tier it is an onboard, whose allocation is recorded here with it, never left pending."""
        lc = src.lc
        pg = self.pool_group_of[lc]
        page = Page(lc, 0, slot, priority, held=True)
        from_pool = self._primary[pg] if src.tier == 0 else self._secondary[pg]
        t = now()
        self._primary[pg].tensor[slot].copy_(from_pool.tensor[src.slot])
        if self.stats_enabled:
            self.residency.copied(0, src.tier, t)
        if record:
            if src.tier == 0:
                self._count(lc, COPY, COPY_BYTES)
            else:
                self._record_onboard(lc)
        self.release(src, active=False)
        return page

    def commit_stats(self, pending: PendingStats | None) -> KVCacheStatsDelta:
        """Move a request's pending stats into the totals and iteration deltas (None: it records nothing).
        Peaks are sampled first, and only when a gauge may have changed since the last sample."""
        if pending is None:
            return EMPTY_DELTA
        if self._dirty:
            self._sample_peaks()
        if not pending.any:  # most decode steps
            return EMPTY_DELTA
        return pending.commit(self._iter, self._totals)

    # ---- tier moves and their records ----------------------------------------------------------------------
    def _pool(self, page: Page) -> SlotPool:
        pools = self._primary if page.tier == 0 else self._secondary
        return pools[self.pool_group_of[page.lc]]

    def _move(self, page: Page, tier: int, slot: int) -> None:
        """Copy a page into `slot` of the other tier and free its old slot."""
        src = self._pool(page)
        dst = (self._primary if tier == 0 else self._secondary)[self.pool_group_of[page.lc]]
        t = now()
        dst.tensor[slot].copy_(src.tensor[page.slot])
        if self.stats_enabled:
            self.residency.copied(tier, 1 - tier, t)
        if tier == 0:  # back on the primary tier: a new residency there
            page.born = page.touched = page.idle = t
        src.free.append(page.slot)
        page.tier, page.slot = tier, slot
        if self.kv_events is not None and page.node is not None and page.lc == self.anchor_lc:
            self.kv_events.moved(page.node, tier)

    def _count(self, lc: int, blocks: int, nbytes: int) -> None:
        """One block of life cycle lc, and its bytes, into the iteration counters `blocks` and `nbytes`."""
        c = self._iter[lc]
        c[blocks] += 1
        c[nbytes] += self._lc_bytes[lc]

    def _record_onboard(self, lc: int) -> None:
        self._count(lc, ONBOARD, ONBOARD_BYTES)
        c = self._iter[lc]
        c[ALLOC_TOTAL] += 1
        c[ALLOC_NEW] += 1
        self._totals[0] += 1
        self._totals[1] += 1

    def _host_slot(self, pg: int, record: bool) -> int:
        s = self._secondary[pg]
        if not s.free:
            self._drop(s.pop_evictable(), record)
        return s.free.pop()

    def _offload(self, page: Page, record: bool) -> None:
        self._move(page, 1, self._host_slot(self.pool_group_of[page.lc], record))
        if record:
            self._count(page.lc, OFFLOAD, OFFLOAD_BYTES)

    def _evict_primary(self, page: Page, record: bool) -> None:
        if self.stats_enabled:
            self.residency.evicted(page, now())
        s = self._secondary[self.pool_group_of[page.lc]]
        if s is not None and (s.free or s.num_evictable):
            self._offload(page, record)
            s.add_evictable(page)
        else:
            self._drop(page, record)

    def _drop(self, page: Page, record: bool) -> None:
        """Free the slot of an unheld, already unlisted page and forget it in the tree."""
        self._pool(page).free.append(page.slot)
        node = page.node
        if node is not None:
            if self.kv_events is not None and page.lc == self.anchor_lc:
                self.kv_events.removed(node, page.tier)
            node.pages[page.lc] = None
            page.node = None
            self.reuse.prune(node)
        page.slot = page.tier = -1
        if record:
            self._count(page.lc, DROPPED, DROPPED_BYTES)

    def _sample_peaks(self) -> None:
        for pool in self._pools:
            pool.sample_peaks()
        self._dirty = False
