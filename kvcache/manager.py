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
"""

import logging

import torch

from .attention import cdiv
from .cache import KVCache
from .config import KVCacheManagerConfig, derive_layout, split_quota
from .pool import Page, SlotPool
from .stats import (
    ALLOC_NEW,
    ALLOC_TOTAL,
    DROPPED,
    DROPPED_BYTES,
    NUM_COUNTERS,
    OFFLOAD,
    OFFLOAD_BYTES,
    ONBOARD,
    ONBOARD_BYTES,
    KvCacheIterationReport,
    KvCacheStats,
    PoolGroupSnapshot,
)
from .tree import Node

log = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, config: KVCacheManagerConfig) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.life_cycles, self.pool_groups = derive_layout(config)
        self._lc_of_layer = {layer.layer_id: lc.id for lc in self.life_cycles for layer in lc.layers}
        self._lc_pg = [lc.pool_group for lc in self.life_cycles]
        self._lc_bytes = [lc.slot_bytes for lc in self.life_cycles]
        # the life cycles whose blocks go stale as history grows: the only ones commit() looks at
        self.windowed = [cycle for cycle in self.life_cycles if cycle.attention.can_go_stale]
        self._pg_lcs = [pg.life_cycles for pg in self.pool_groups]
        pri = split_quota(config.gpu_cache_bytes, self.pool_groups)
        sec = split_quota(config.host_cache_bytes, self.pool_groups)
        if min(pri) < 1:
            need = sum(len(pg.life_cycles) * pg.slot_bytes for pg in self.pool_groups)
            raise ValueError(
                f"gpu_cache_bytes={config.gpu_cache_bytes} holds no block; at least {need} bytes are needed"
            )
        pin = torch.cuda.is_available()
        self._primary = [SlotPool(n, pg.slot_bytes, config.device) for n, pg in zip(pri, self.pool_groups, strict=True)]
        self._secondary = [
            SlotPool(n, pg.slot_bytes, "cpu", pin=pin) if config.host_cache_bytes and n else None
            for n, pg in zip(sec, self.pool_groups, strict=True)
        ]
        self._stats_on = config.enable_stats
        self._rec = self._stats_on  # whether the operation in progress records statistics
        self._iter = [[0] * NUM_COUNTERS for _ in self.life_cycles]
        self._totals = [0, 0, 0, 0]  # alloc_total, alloc_new, reused, missed
        self._pools = [p for p in self._primary + self._secondary if p is not None]
        self._lc_meta = [{"id": lc.id, "pool_group": lc.pool_group, "window_key": lc.window_key, "kind": lc.kind}
                         for lc in self.life_cycles]
        self._dirty = False
        self._roots: dict = {}
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        log.info("kv cache: %d life cycles, %d pool groups, primary slots %s, host slots %s, device %s",
                 len(self.life_cycles), len(self.pool_groups), pri,
                 [p.num_slots if p else 0 for p in self._secondary], config.device)

    # ---- public API -----------------------------------------------------------------------------------
    def create_kv_cache(self, request_id, input_tokens, expected_prompt_length: int | None = None,
                        cache_salt=None, exclude_from_stats: bool = False) -> KVCache:
        return KVCache(self, request_id, input_tokens, expected_prompt_length, cache_salt, exclude_from_stats)

    def life_cycle_of_layer(self, layer_id: int) -> int:
        return self._lc_of_layer[layer_id]

    def layer_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Primary-tier K and V of one layer, each `[num_slots, tokens_per_block, num_kv_heads, head_dim]`."""
        views = self._views.get(layer_id)
        if views is None:
            lc = self.life_cycles[self._lc_of_layer[layer_id]]
            layer = next(la for la in lc.layers if la.layer_id == layer_id)
            pool = self._primary[lc.pool_group]
            off = lc.layer_offsets[layer_id]
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
        if not self._stats_on:
            return None
        self._sample_peaks()
        counters = self._iter
        self._iter = [[0] * NUM_COUNTERS for _ in counters]
        groups = []
        for pg in self.pool_groups:
            tiers = []
            for pools in (self._primary, self._secondary):
                pool = pools[pg.id]
                if pool is None:
                    tiers.append((0,) * 7)
                    continue
                tiers.append(pool.drain_gauges())
            groups.append(PoolGroupSnapshot(pg.id, pg.slot_bytes, list(pg.window_keys), tiers[0], tiers[1]))
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

    # ---- slots and tier moves ---------------------------------------------------------------------------
    def _can_take(self, pg: int, k: int) -> bool:
        p = self._primary[pg]
        have = len(p.free) + p.num_evictable
        if have >= k:
            return True
        s = self._secondary[pg]
        return s is not None and have + min(len(p.suspended), len(s.free) + s.num_evictable) >= k

    def _take(self, pg: int, k: int) -> list[int]:
        """k primary slots of pool group pg; the caller checked `_can_take` first."""
        p = self._primary[pg]
        short = k - len(p.free) - p.num_evictable
        while short > 0:  # offload pages that only suspended requests hold
            page = next(iter(p.suspended))
            del p.suspended[page]
            self._offload(page)
            short -= 1
        while len(p.free) < k:
            self._evict_primary(p.pop_evictable())
        return [p.free.pop() for _ in range(k)]

    def _host_slot(self, pg: int) -> int:
        s = self._secondary[pg]
        if not s.free:
            self._drop(s.pop_evictable())
        return s.free.pop()

    def _offload(self, page: Page) -> None:
        pg = self._lc_pg[page.lc]
        p, s = self._primary[pg], self._secondary[pg]
        slot = self._host_slot(pg)
        s.tensor[slot].copy_(p.tensor[page.slot])
        p.free.append(page.slot)
        page.tier, page.slot = 1, slot
        if self._rec:
            c = self._iter[page.lc]
            c[OFFLOAD] += 1
            c[OFFLOAD_BYTES] += self._lc_bytes[page.lc]

    def _onboard(self, page: Page, slot: int) -> None:
        pg = self._lc_pg[page.lc]
        p, s = self._primary[pg], self._secondary[pg]
        p.tensor[slot].copy_(s.tensor[page.slot])
        s.free.append(page.slot)
        page.tier, page.slot = 0, slot
        if self._rec:
            c = self._iter[page.lc]
            c[ONBOARD] += 1
            c[ONBOARD_BYTES] += self._lc_bytes[page.lc]
            c[ALLOC_TOTAL] += 1
            c[ALLOC_NEW] += 1
            self._totals[0] += 1
            self._totals[1] += 1

    def _evict_primary(self, page: Page) -> None:
        s = self._secondary[self._lc_pg[page.lc]]
        if s is not None and (s.free or s.num_evictable):
            self._offload(page)
            s.add_evictable(page)
        else:
            self._drop(page)

    def _drop(self, page: Page) -> None:
        """Free the slot of an unheld, already unlisted page and forget it in the tree."""
        pools = self._primary if page.tier == 0 else self._secondary
        pools[self._lc_pg[page.lc]].free.append(page.slot)
        node = page.node
        if node is not None:
            node.pages[page.lc] = None
            page.node = None
            node.prune()
        page.slot = page.tier = -1
        if self._rec:
            c = self._iter[page.lc]
            c[DROPPED] += 1
            c[DROPPED_BYTES] += self._lc_bytes[page.lc]

    def _release(self, page: Page, active: bool) -> None:
        """A request lets go of a page."""
        page.ref -= 1
        if active:
            page.active_ref -= 1
        if page.tier != 0:
            pool = self._secondary[self._lc_pg[page.lc]]
            if page.ref == 0:
                if page.node is not None:
                    pool.add_evictable(page)
                else:
                    pool.free.append(page.slot)
            return
        pool = self._primary[self._lc_pg[page.lc]]
        if page.ref == 0:
            pool.suspended.pop(page, None)
            if page.node is not None:
                pool.add_evictable(page)
            else:
                pool.free.append(page.slot)
        elif page.active_ref == 0:
            pool.suspended[page] = None

    def _hold(self, page: Page) -> None:
        """An inactive request takes a page (a reuse match); the caller marks the gauges dirty."""
        if page.ref == 0:
            pools = self._primary if page.tier == 0 else self._secondary
            pools[self._lc_pg[page.lc]].remove_evictable(page)
        page.ref += 1
        if page.tier == 0 and page.active_ref == 0:
            self._primary[self._lc_pg[page.lc]].suspended[page] = None

    def _sample_peaks(self) -> None:
        for pool in self._pools:
            pool.sample_peaks()
        self._dirty = False

    # ---- reuse tree -------------------------------------------------------------------------------------
    def _root(self, salt) -> Node:
        # keyed by type and value: salts 1, True and 1.0 compare equal but are different tenants
        key = (type(salt), salt)
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = Node((), None, len(self.life_cycles))
        return root

    def _match(self, root: Node, tokens: list, limit: int) -> tuple[int, list[Node], Node | None]:
        """Longest reusable prefix: (matched tokens, full-block nodes, node of the partial block or None)."""
        B = self.tokens_per_block
        nodes: list[Node] = []
        node = root
        for o in range(limit // B):
            child = node.children.get(tuple(tokens[o * B:(o + 1) * B]))
            if child is None:
                break
            nodes.append(child)
            node = child
        n = len(nodes) * B
        partial = None
        if self.config.enable_partial_reuse and n < limit:
            partial, m = node.best_partial(tokens[n:], min(limit - n, B - 1))
            n += m
        n = self._valid_length(nodes + [partial], n)
        if n % B == 0:
            partial = None
        return n, nodes[: n // B], partial

    def _valid_length(self, holders: list, n: int) -> int:
        """Shrink n until every life cycle has a page for each block it needs (all but the stale ones) at
        history n; `holders[o]` is the node of ordinal o. Shrinking moves the stale ranges, so repeat until
        no life cycle shrinks it further."""
        B = self.tokens_per_block
        changed = True
        while changed and n > 0:
            changed = False
            for lc, cycle in enumerate(self.life_cycles):
                while n > 0:
                    start, end = cycle.attention.stale_range(n)
                    missing = _last_missing(holders, lc, cdiv(n, B), start, end)
                    if missing < 0:
                        break
                    n = missing * B
                    changed = True
        return n


def _last_missing(holders: list, lc: int, nb: int, start: int, end: int) -> int:
    """The highest ordinal below nb and outside the stale range [start, end) whose holder has no page of
    life cycle lc, or -1."""
    for o in range(nb - 1, end - 1, -1):
        if holders[o].pages[lc] is None:
            return o
    for o in range(start - 1, -1, -1):
        if holders[o].pages[lc] is None:
            return o
    return -1
