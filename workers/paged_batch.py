"""One forward pass's sequences and the plans their paged attention reads the KV cache by.

`Batch` holds every sequence's place in the flat `[T, hidden]` batch and its positions, and builds (once per
life cycle and window, on first use) the block-table plans that attention gathers K/V through: per sequence
for prefill chunks (`AttnPlan`), and one padded plan for a batch of decodes (`DecodePlan`). Stale
sliding-window blocks (id -1) are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SeqView:
    """Per-forward bookkeeping of one sequence: where its rows sit in the flat batch, and its positions."""

    offset: int
    n: int
    start: int
    kv: Any
    positions: torch.Tensor  # [n] on the model's device
    plans: dict[tuple[int, int | None], AttnPlan]  # by (life cycle id, window), built on first use


@dataclass
class AttnPlan:
    """Where one sequence writes and reads for one (life cycle, window), shared by the layers with both."""

    write_slots: torch.Tensor  # [n] slot id per new token
    write_offsets: torch.Tensor  # [n] position inside the block
    read_slots: torch.Tensor  # [nb] slots covering key positions [read_lo_block * B, ...)
    key_lo: int  # first key position read, relative to read_lo_block * B
    key_len: int
    mask: torch.Tensor | None  # [n, key_len] bool, True = attend; None = the one query sees every key


@dataclass
class DecodePlan:
    """All one-token sequences of a forward, attended in one padded batch for one (life cycle, window)."""

    rows: torch.Tensor  # [S] rows of the flat batch
    write_slots: torch.Tensor  # [S]
    write_offsets: torch.Tensor  # [S]
    table: torch.Tensor  # [S, max_blocks] slots, padded with slot 0 (masked out)
    key_lo: torch.Tensor  # [S] int64: the first key position read, relative to the table's first block
    key_len: torch.Tensor  # [S] int64
    valid: torch.Tensor  # [S, max_blocks * B] bool: key inside [key_lo, key_lo + key_len)
    invalid: tuple[torch.Tensor, torch.Tensor]  # (sequence, key) indices of the other positions


class Batch:
    """Everything attention needs about one forward pass; plans are cached per sequence.

    Plans are keyed by (life cycle, window) rather than life cycle alone: kvcache folds a window
    `>= max_seq_len` into the full-attention life cycle, and the layer's own window still shapes its mask.
    Sequences with one new token (decode) are attended together, padded to the longest; longer ones
    (prefill chunks) one by one.
    """

    def __init__(self, seqs: list[SeqView], kv_manager: Any, device: torch.device):
        self.seqs = seqs
        self.decodes = [s for s in seqs if s.n == 1]
        self.prefills = [s for s in seqs if s.n > 1]
        self.mgr = kv_manager
        self.block = int(kv_manager.tokens_per_block)
        self.device = device
        self._decode_plans: dict[tuple[int, int | None], DecodePlan] = {}

    def decode_plan(self, lc: int, window: int | None) -> DecodePlan:
        d = self._decode_plans.get((lc, window))
        if d is None:
            d = self._decode_plans[lc, window] = self._build_decode_plan(lc, window)
        return d

    def _build_decode_plan(self, lc: int, window: int | None) -> DecodePlan:
        """Every decoding sequence's table from plain ints, then one tensor per field. A per-sequence `AttnPlan`
        (several small tensors each, each a host-to-device copy on a GPU) was ~14% of a rank's samples in
        engine_bench's decode (py-spy, built-in model, 16 sequences): its forward 3.76 -> 2.91 ms a step; on
        SmolLM2 the matmuls dominate (decode_bench: 85% aten::mm) and this is noise."""
        B, dev = self.block, self.device
        rows, tables, write_slots, write_offsets, key_lo, key_len = [], [], [], [], [], []
        for s in self.decodes:
            ids = s.kv.block_ids(lc)
            pos = s.start  # its one new token's position
            last_block = pos // B
            if last_block >= len(ids):
                raise RuntimeError(
                    f"kv cache holds {len(ids)} blocks ({len(ids) * B} tokens) for life cycle {lc}, "
                    f"but positions up to {pos} are being written: resize the cache first"
                )
            lo = 0 if window is None else max(0, pos - window + 1)
            first_block = lo // B
            read = ids[first_block : last_block + 1]
            if min(read) < 0:
                stale = [first_block + k for k, i in enumerate(read) if i < 0]
                raise RuntimeError(
                    f"life cycle {lc}: block ordinal(s) {stale} are stale (-1) but inside the attention "
                    f"window of positions [{pos}, {pos + 1}) (window {window})"
                )
            rows.append(s.offset)
            tables.append(read)
            write_slots.append(read[-1])
            write_offsets.append(pos % B)
            key_lo.append(lo - first_block * B)
            key_len.append(pos + 1 - lo)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
        idx = torch.arange(width * B, device=dev)[None, :]
        lo_t = torch.tensor(key_lo, dtype=torch.long, device=dev)
        len_t = torch.tensor(key_len, dtype=torch.long, device=dev)
        valid = (idx >= lo_t[:, None]) & (idx < (lo_t + len_t)[:, None])
        return DecodePlan(
            rows=torch.tensor(rows, device=dev),
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=dev),
            write_offsets=torch.tensor(write_offsets, dtype=torch.long, device=dev),
            table=table,
            key_lo=lo_t,
            key_len=len_t,
            valid=valid,
            invalid=torch.nonzero(~valid, as_tuple=True),
        )

    def plan(self, s: SeqView, lc: int, window: int | None) -> AttnPlan:
        p = s.plans.get((lc, window))
        if p is None:
            p = s.plans[lc, window] = self._build_plan(s, lc, window)
        return p

    def _build_plan(self, s: SeqView, lc: int, window: int | None) -> AttnPlan:
        B = self.block
        ids = list(s.kv.block_ids(lc))
        end = s.start + s.n  # exclusive
        last_block = (end - 1) // B
        if last_block >= len(ids):
            raise RuntimeError(
                f"kv cache holds {len(ids)} blocks ({len(ids) * B} tokens) for life cycle {lc}, "
                f"but positions up to {end - 1} are being written: resize the cache first"
            )
        lo = 0 if window is None else max(0, s.start - window + 1)
        first_block = lo // B
        needed = ids[first_block : last_block + 1]
        if any(i < 0 for i in needed):
            stale = [first_block + k for k, i in enumerate(needed) if i < 0]
            raise RuntimeError(
                f"life cycle {lc}: block ordinal(s) {stale} are stale (-1) but inside the attention "
                f"window of positions [{s.start}, {end}) (window {window})"
            )
        dev = self.device
        write_blocks = s.positions // B
        table = torch.tensor(ids[: last_block + 1], dtype=torch.long, device=dev)
        q_pos = s.positions[:, None]
        k_pos = torch.arange(lo, end, device=dev)[None, :]
        mask: torch.Tensor | None = None
        if s.n > 1:  # one query sees exactly keys [lo, start]: no mask needed
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        return AttnPlan(
            write_slots=table[write_blocks],
            write_offsets=s.positions % B,
            read_slots=table[first_block:],
            key_lo=lo - first_block * B,
            key_len=end - lo,
            mask=mask,
        )
