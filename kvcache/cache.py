"""One request's KV cache: its pages per life cycle, its place in the reuse tree, its pending statistics.

Allocations are recorded as pending block-ordinal segments `[start, end, kind]` per life cycle, so a shrink
before `commit_pending_stats()` rolls back exactly the overlapped part, newest segment first, and `close()`
discards whatever is still pending. Everything here costs O(blocks touched) per call.
"""

from typing import TYPE_CHECKING

from .attention import cdiv
from .pool import DEFAULT_PRIORITY, Page
from .stats import (
    ALLOC_NEW,
    ALLOC_TOTAL,
    COPY,
    COPY_BYTES,
    EMPTY_DELTA,
    FULL_REUSED,
    GEN_ALLOC,
    MISSED,
    ONBOARD,
    ONBOARD_BYTES,
    PARTIAL_REUSED,
    REUSED,
    KVCacheStatsDelta,
)

if TYPE_CHECKING:
    from .manager import KVCacheManager

SEG_MISS, SEG_GEN, SEG_PLAIN = 0, 1, 2


class KVCacheError(RuntimeError):
    """Misuse of a KV cache (commit beyond capacity, use after close, ...). Nothing was changed."""


class KVCache:
    def __init__(self, mgr: "KVCacheManager", request_id, input_tokens, expected_prompt_length: int | None,
                 cache_salt, exclude_from_stats: bool) -> None:
        cfg = mgr.config
        tokens = list(input_tokens)
        if len(tokens) > cfg.max_seq_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(tokens)} tokens is longer than "
                             f"max_seq_len={cfg.max_seq_len}")
        if expected_prompt_length is None:
            expected_prompt_length = len(tokens)
        if not 0 <= expected_prompt_length <= cfg.max_seq_len:
            raise ValueError(f"request {request_id!r}: expected_prompt_length={expected_prompt_length} "
                             f"is outside [0, max_seq_len={cfg.max_seq_len}]")
        try:
            hash(cache_salt)
        except TypeError as e:
            raise TypeError(f"cache_salt must be hashable, got {type(cache_salt).__name__}") from e
        self._mgr = mgr
        self.request_id = request_id
        self.expected_prompt_length = expected_prompt_length
        self.priority = DEFAULT_PRIORITY
        self._stats = mgr._stats_on and not exclude_from_stats
        n_lc = len(mgr.life_cycles)
        self._pages: list[list[Page | None]] = [[] for _ in range(n_lc)]
        self._segs: list[list[list[int]]] = [[] for _ in range(n_lc)]
        self._reuse = [[0, 0] for _ in range(n_lc)]  # pending (full, partial) reuse per life cycle
        self._reuse_pending = False
        self._pending = False
        self._active = False
        self._closed = False
        self._partial_src = False  # the block at ordinal history // B is still a shared source page
        self._root = mgr._root(cache_salt) if cfg.enable_block_reuse else None
        self._nodes = []
        n = 0
        if self._root is not None and len(tokens) > 1:
            n, self._nodes, partial = mgr._match(self._root, tokens, len(tokens) - 1)
            if n:
                self._adopt(n, partial)
            if self._nodes:
                self._nodes[-1].tails += 1  # we publish under it: it stays in the tree while we live
        self.num_reused_tokens = n
        self._history = n
        self._tokens = tokens[:n]
        self._capacity = n
        self._nb = cdiv(n, mgr.tokens_per_block)
        # per life cycle, the ordinal below which stale blocks are released (sink blocks never are), and the
        # history at which the block at that ordinal goes stale
        self._released_to = [max(cycle.attention.stale_range(n)[1], cycle.attention.sink_blocks)
                             for cycle in mgr.life_cycles]
        self._stale_at = [cycle.attention.stale_at(o) for cycle, o in zip(mgr.life_cycles, self._released_to,
                                                                          strict=True)]

    def _adopt(self, n: int, partial) -> None:
        """Hold the matched pages (stale sliding-window blocks are matched but get no page)."""
        mgr = self._mgr
        B = mgr.tokens_per_block
        nb = cdiv(n, B)
        full = n // B
        for lc, cycle in enumerate(mgr.life_cycles):
            start, end = cycle.attention.stale_range(n)
            pages = self._pages[lc]
            counted = 0
            for o in range(nb):
                if start <= o < end:
                    pages.append(None)
                    continue
                page = (self._nodes[o] if o < full else partial).pages[lc]
                mgr._hold(page)
                pages.append(page)
                counted += o < full
            if self._stats:
                self._reuse[lc][0] += counted
                self._reuse[lc][1] += 1 if n % B else 0
        self._partial_src = n % B != 0
        self._pending = self._reuse_pending = self._stats
        mgr._dirty = True  # held pages are no longer evictable

    # ---- state ------------------------------------------------------------------------------------------
    @property
    def history_length(self) -> int:
        return self._history

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def is_active(self) -> bool:
        return self._active

    @property
    def is_closed(self) -> bool:
        return self._closed

    def set_priority(self, priority: int) -> None:
        """Retention priority of this request's blocks once released (lower is evicted first)."""
        self.priority = priority
        for pages in self._pages:
            for page in pages:
                if page is not None and page.ref == 1:
                    page.priority = priority

    def block_ids(self, life_cycle_id: int) -> list[int]:
        """Primary slot id of each block ordinal; -1 where the block is stale (outside the window)."""
        if not self._active:
            raise KVCacheError(f"request {self.request_id!r}: block_ids() of an inactive cache; resume() first")
        return [-1 if p is None else p.slot for p in self._pages[life_cycle_id]]

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise KVCacheError(f"request {self.request_id!r}: {op}() after close()")

    # ---- life cycle ---------------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Lock every page on the primary tier (onboarding from the host tier) and make the partially reused
        block private. False = no room, and nothing changed."""
        self._check_open("resume")
        return self._active or self._activate(0)

    def _activate(self, grow: int) -> bool:
        """Resume, checking room for the resume and for `grow` more blocks per life cycle together, so that a
        resize of an inactive cache that fails changes nothing either."""
        mgr = self._mgr
        B = mgr.tokens_per_block
        need = [0] * len(mgr.pool_groups)
        po = self._history // B if self._partial_src else -1
        mine = []
        for lc, pages in enumerate(self._pages):
            pg = mgr._lc_pg[lc]
            for o, page in enumerate(pages):
                if page is None:
                    continue
                if o == po:
                    need[pg] += 1  # the private copy
                    continue
                mine.append(page)
                if page.tier != 0:
                    need[pg] += 1
        for page in mine:  # ours are not offloadable while we look for room
            page.active_ref += 1
            if page.active_ref == 1 and page.tier == 0:
                mgr._primary[mgr._lc_pg[page.lc]].suspended.pop(page, None)
        if not all(mgr._can_take(pg, k + grow * len(mgr._pg_lcs[pg])) for pg, k in enumerate(need)):
            for page in mine:
                page.active_ref -= 1
                if page.active_ref == 0 and page.tier == 0:
                    mgr._primary[mgr._lc_pg[page.lc]].suspended[page] = None
            return False
        mgr._rec = self._stats
        slots = [mgr._take(pg, k) if k else [] for pg, k in enumerate(need)]
        for page in mine:
            if page.tier != 0:
                mgr._onboard(page, slots[mgr._lc_pg[page.lc]].pop())
        if po >= 0:
            self._copy_partial(po, slots)
        self._active = True
        mgr._dirty = True
        return True

    def _copy_partial(self, o: int, slots: list[list[int]]) -> None:
        mgr = self._mgr
        for lc, pages in enumerate(self._pages):
            src = pages[o]
            if src is None:
                continue
            pg = mgr._lc_pg[lc]
            page = Page(lc, 0, slots[pg].pop(), self.priority)
            page.ref = page.active_ref = 1
            from_pool = mgr._primary[pg] if src.tier == 0 else mgr._secondary[pg]
            mgr._primary[pg].tensor[page.slot].copy_(from_pool.tensor[src.slot])
            pages[o] = page
            mgr._release(src, active=False)
            if self._stats:
                c = mgr._iter[lc]
                nbytes = mgr._lc_bytes[lc]
                if src.tier == 0:
                    c[COPY] += 1
                    c[COPY_BYTES] += nbytes
                    self._add_segment(lc, o, o + 1, SEG_PLAIN)
                else:  # an onboard: its allocation is recorded with it, as _onboard does, never left pending
                    c[ONBOARD] += 1
                    c[ONBOARD_BYTES] += nbytes
                    c[ALLOC_TOTAL] += 1
                    c[ALLOC_NEW] += 1
                    mgr._totals[0] += 1
                    mgr._totals[1] += 1
        self._partial_src = False

    def suspend(self) -> None:
        """Let this request's pages be offloaded (preemption); resume() brings them back."""
        self._check_open("suspend")
        if not self._active:
            return
        mgr = self._mgr
        for pages in self._pages:
            for page in pages:
                if page is not None:
                    page.active_ref -= 1
                    if page.active_ref == 0 and page.tier == 0:
                        mgr._primary[mgr._lc_pg[page.lc]].suspended[page] = None
        self._active = False

    def resize(self, capacity: int) -> bool:
        """Grow or shrink to `capacity` tokens (resuming a fresh or suspended cache first).
        False = no room, and nothing changed."""
        mgr = self._mgr
        if not self._active or not self._history <= capacity <= mgr.config.max_seq_len:
            self._check_resize(capacity)
            grow = max(0, cdiv(capacity, mgr.tokens_per_block) - self._nb)
            if not self._active and not self._activate(grow):  # a fresh or suspended cache is resumed first
                return False
        old, new = self._nb, cdiv(capacity, mgr.tokens_per_block)
        if new == old:  # the common decode step: no new block
            self._capacity = capacity
            return True
        if new > old:
            n = new - old
            pg_lcs = mgr._pg_lcs
            for pg, lcs in enumerate(pg_lcs):
                if not mgr._can_take(pg, n * len(lcs)):
                    return False
            mgr._rec = self._stats
            kind = SEG_MISS if self._history < self.expected_prompt_length else SEG_GEN
            prio = self.priority
            for pg, lcs in enumerate(pg_lcs):
                slots = mgr._take(pg, n * len(lcs))
                for lc in lcs:
                    pages = self._pages[lc]
                    for _ in range(n):
                        page = Page(lc, 0, slots.pop(), prio)
                        page.ref = page.active_ref = 1
                        pages.append(page)
                    if self._stats:  # _add_segment, inlined on the hot path
                        segs = self._segs[lc]
                        if segs and segs[-1][1] == old and segs[-1][2] == kind:
                            segs[-1][1] = new
                        else:
                            segs.append([old, new, kind])
            self._pending = self._pending or self._stats
            mgr._dirty = True
        elif new < old:
            for lc, pages in enumerate(self._pages):
                for _ in range(old - new):
                    page = pages.pop()
                    if page is not None:
                        mgr._release(page, active=True)
                segs = self._segs[lc]
                while segs and segs[-1][1] > new:
                    seg = segs[-1]
                    seg[1] = max(seg[0], new)
                    if seg[1] == seg[0]:
                        segs.pop()
            mgr._dirty = True
        self._nb = new
        self._capacity = capacity
        return True

    def _check_resize(self, capacity: int) -> None:
        self._check_open("resize")
        if capacity < self._history:
            raise KVCacheError(f"request {self.request_id!r}: resize({capacity}) below history_length "
                               f"{self._history}")
        if capacity > self._mgr.config.max_seq_len:
            raise KVCacheError(f"request {self.request_id!r}: resize({capacity}) beyond max_seq_len "
                               f"{self._mgr.config.max_seq_len}")

    def _add_segment(self, lc: int, start: int, end: int, kind: int) -> None:
        segs = self._segs[lc]
        if segs and segs[-1][1] == start and segs[-1][2] == kind:
            segs[-1][1] = end
        else:
            segs.append([start, end, kind])
        self._pending = True

    def commit(self, tokens) -> None:
        """These tokens' KV is written: history grows, full blocks are published, stale blocks released."""
        if not self._active:
            self._check_open("commit")
            raise KVCacheError(f"request {self.request_id!r}: commit() of an inactive cache; resume() first")
        n = len(tokens)
        h = self._history + n
        if h > self._capacity:
            raise KVCacheError(f"request {self.request_id!r}: commit of {n} tokens beyond capacity "
                               f"{self._capacity} (history {self._history})")
        self._tokens += tokens
        self._history = h
        mgr = self._mgr
        B = mgr.tokens_per_block
        if self._root is not None and h // B > len(self._nodes):
            for o in range(len(self._nodes), h // B):
                self._publish(o, B)
        for cycle in mgr.windowed:
            if h >= self._stale_at[cycle.id]:
                self._release_stale(cycle, h)

    def _release_stale(self, cycle, h: int) -> None:
        """Release the blocks of a sliding-window life cycle that went stale by history h."""
        mgr = self._mgr
        lc = cycle.id
        end = cycle.attention.stale_range(h)[1]
        pages = self._pages[lc]
        for o in range(self._released_to[lc], end):
            page = pages[o]
            if page is not None:
                pages[o] = None
                mgr._release(page, active=True)
        self._released_to[lc] = end
        self._stale_at[lc] = cycle.attention.stale_at(end)
        mgr._dirty = True

    def _publish(self, o: int, B: int) -> None:
        parent = self._nodes[o - 1] if o else self._root
        end = min((o + 1) * B, self._history)
        node = parent.child(tuple(self._tokens[o * B:end]), len(self._pages))
        node.tails += 1  # the new tail keeps our chain attached (see Node.tails)
        if self._nodes:
            self._nodes[-1].tails -= 1
        for lc, pages in enumerate(self._pages):
            page = pages[o] if o < len(pages) else None
            if page is not None and page.node is None and node.pages[lc] is None:
                node.pages[lc] = page
                page.node = node
            if o and parent.pages[lc] is None:  # the parent's first publisher's page was dropped: give it ours
                mine = pages[o - 1] if o - 1 < len(pages) else None
                if mine is not None and mine.node is None:
                    parent.pages[lc] = mine
                    mine.node = parent
        self._nodes.append(node)

    def commit_pending_stats(self) -> KVCacheStatsDelta:
        """Move this request's pending statistics into the manager's totals and iteration deltas."""
        mgr = self._mgr
        if mgr._dirty and self._stats:
            for pool in mgr._pools:
                pool.sample_peaks()
            mgr._dirty = False
        if not self._pending:  # most decode steps
            return EMPTY_DELTA
        alloc = missed = reused = 0
        iters = mgr._iter
        for lc, segs in enumerate(self._segs):
            if segs:
                c = iters[lc]
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
        if self._reuse_pending:  # once per request, after its reuse match
            for lc, r in enumerate(self._reuse):
                c = iters[lc]
                c[FULL_REUSED] += r[0]
                c[PARTIAL_REUSED] += r[1]
                c[REUSED] += r[0] + r[1]
                reused += r[0] + r[1]
                r[0] = r[1] = 0
            self._reuse_pending = False
        t = mgr._totals
        t[0] += alloc
        t[1] += alloc
        t[2] += reused
        t[3] += missed
        self._pending = False
        return KVCacheStatsDelta(alloc, alloc, reused, missed)

    def close(self) -> None:
        """Discard pending stats, publish the trailing partial block, release every page."""
        if self._closed:
            return
        mgr = self._mgr
        B = mgr.tokens_per_block
        for segs in self._segs:
            segs.clear()
        for r in self._reuse:
            r[0] = r[1] = 0
        self._pending = self._reuse_pending = False
        if (self._root is not None and self._history % B and not self._partial_src
                and len(self._nodes) == self._history // B):
            self._publish(self._history // B, B)
        for pages in self._pages:
            while pages:
                page = pages.pop()
                if page is not None:
                    mgr._release(page, self._active)
        if self._nodes:
            tail = self._nodes[-1]
            tail.tails -= 1
            tail.prune()  # only if its pages were dropped while we held it as our tail
        self._active = False
        self._closed = True
        mgr._dirty = True

    def __repr__(self) -> str:
        return (f"KVCache({self.request_id!r}, history={self._history}, capacity={self._capacity}, "
                f"active={self._active})")
