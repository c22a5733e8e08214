"""Serve's autoscaling policies for the engine deployment (`KVFleetEngine`): `autoscaling_policy: kv` and
`threshold` (settings.py; `serve` is Serve's own default and has no code here).

Each engine replica reports an `engine.messages.LoadReport` through `record_autoscaling_stats`; Serve averages
every field per replica over its look-back window and hands the policy `ctx.aggregated_metrics`
({field: {replica id: value}}), with only the running replicas that have reported. A policy returns the number
of replicas it wants (a float is rounded up) and a state Serve keeps and shows; Serve itself then applies its
scaling factors, `upscale_delay_s` / `downscale_delay_s` and the min / max bounds, so none of that is here.

Serve cloudpickles this module by value into its controller, which may not have kvfleet's packages: the
policies read only `_FIELDS` (plain strings), so the pickle carries no reference to `engine`, and this module
imports nothing but the stdlib and light, torch-free modules.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from ray.serve.config import AutoscalingContext

from engine.messages import LoadReport

_FIELDS = tuple(f.name for f in fields(LoadReport))

Loads = dict[str, dict[Any, float]]  # field name -> {replica id: value}, as Serve aggregates them


def _loads(ctx: AutoscalingContext) -> Loads | None:
    """The replicas' reported load, field by field; None while no replica has reported any field yet."""
    metrics = ctx.aggregated_metrics or {}
    loads = {name: dict(metrics.get(name) or {}) for name in _FIELDS}
    return loads if any(loads.values()) else None


def _total(loads: Loads, name: str) -> float:
    return float(sum(loads[name].values()))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class KVAutoscalingPolicy:
    """`autoscaling_policy: kv`: as many replicas as the exact load of the engines needs.

    - prefill need = uncached prompt tokens (summed over replicas) / (prefill tokens per second of one replica x
      `ttft_target_s`). Uncached prompt tokens are the work that makes the time to first token: tokens some dp
      group already holds cost nothing. A replica's rate is the mean of those the replicas measured (> 0), else
      `prefill_tokens_per_s`; with neither, the term is 0.
    - demand need = uncached prompt tokens arriving a second (summed) / (that rate x `target_occupancy`): the
      fleet grows with the arrivals, not only once they have queued.
    - sequence need = (running + waiting, summed) / (mean slots per replica x `target_occupancy`).
    - desired = the largest need; while any replica is short of KV blocks (`short_groups`: it evicts blocks its
      queue needs) at least one replica more than are running.
    - below the running replicas, ceil(desired / `downscale_margin`) (never fewer than 1): the replicas left keep
      headroom, so a load near a boundary does not flap and each scale-down, which throws a KV cache away, is worth it.
    - no report yet: the current target, so no change.
    """

    def __init__(self, ttft_target_s: float = 2.0, prefill_tokens_per_s: float = 0.0, target_occupancy: float = 0.8,
                 downscale_margin: float = 0.8) -> None:
        if ttft_target_s <= 0 or prefill_tokens_per_s < 0:
            raise ValueError(f"need ttft_target_s > 0 and prefill_tokens_per_s >= 0, got {ttft_target_s}, "
                             f"{prefill_tokens_per_s}")
        if not 0 < target_occupancy <= 1 or not 0 < downscale_margin <= 1:
            raise ValueError(f"need target_occupancy and downscale_margin in (0, 1], got {target_occupancy}, "
                             f"{downscale_margin}")
        self.ttft_target_s = ttft_target_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.target_occupancy = target_occupancy
        self.downscale_margin = downscale_margin

    def __call__(self, ctx: AutoscalingContext) -> tuple[float | int, dict[str, Any]]:
        loads = _loads(ctx)
        if loads is None:
            return ctx.target_num_replicas, {}
        current = ctx.current_num_replicas
        prefill = self.prefill_need(loads)
        demand = self.demand_need(loads)
        sequences = self.sequence_need(loads, current)
        short = _total(loads, "short_groups")
        desired = max(prefill, demand, sequences)
        if short > 0:
            desired = max(desired, current + 1)
        elif desired < current:
            desired = min(current, max(1, math.ceil(desired / self.downscale_margin)))
        return desired, {"prefill_need": prefill, "demand_need": demand, "sequence_need": sequences,
                         "short_groups": short}

    def prefill_rate(self, loads: Loads) -> float:
        """One replica's prefill tokens per second: what the replicas measured, else the configured fallback."""
        measured = [rate for rate in loads["prefill_tokens_per_s"].values() if rate > 0]
        return _mean(measured) if measured else self.prefill_tokens_per_s

    def prefill_need(self, loads: Loads) -> float:
        """Replicas whose prefill finishes the uncached prompt tokens now waiting within the TTFT target."""
        rate = self.prefill_rate(loads)
        return _total(loads, "uncached_prompt_tokens") / (rate * self.ttft_target_s) if rate > 0 else 0.0

    def demand_need(self, loads: Loads) -> float:
        """Replicas whose prefill keeps up with the uncached prompt tokens arriving, at the target occupancy: the
        fleet grows with the arrivals, before they leave a queue (the backlog term alone acts only after)."""
        rate = self.prefill_rate(loads)
        if rate <= 0:
            return 0.0
        return _total(loads, "uncached_prompt_tokens_per_s") / (rate * self.target_occupancy)

    def sequence_need(self, loads: Loads, current: int) -> float:
        """Replicas whose slots hold the running and waiting requests at the target occupancy. With no slot
        reported anywhere (every dp group down or still starting) capacity is unknown: `current`, no change."""
        slots = _mean(list(loads["slots"].values()))
        if slots <= 0:
            return float(current)
        return (_total(loads, "running") + _total(loads, "waiting")) / (slots * self.target_occupancy)


class ThresholdAutoscalingPolicy:
    """`autoscaling_policy: threshold`, a baseline: llm-d workload-variant-autoscaler's saturation rule, from
    the mean spare KV room and spare queue of the replicas, one replica at a time.

    - spare KV = mean of (`kv_threshold` - kv_usage), spare queue = mean of (`queue_threshold` - waiting).
    - either below its trigger: one replica more.
    - else, with more than one replica, if the same load spread over one replica fewer keeps both spares at or
      above their triggers: one replica fewer.
    - else, or no report yet: no change.
    """

    def __init__(self, kv_threshold: float = 0.80, queue_threshold: float = 5.0, kv_spare_trigger: float = 0.10,
                 queue_spare_trigger: float = 3.0) -> None:
        self.kv_threshold = kv_threshold
        self.queue_threshold = queue_threshold
        self.kv_spare_trigger = kv_spare_trigger
        self.queue_spare_trigger = queue_spare_trigger

    def __call__(self, ctx: AutoscalingContext) -> tuple[float | int, dict[str, Any]]:
        loads = _loads(ctx)
        if loads is None or not loads["kv_usage"] or not loads["waiting"]:
            return ctx.target_num_replicas, {}
        current = ctx.current_num_replicas
        usage, waiting = list(loads["kv_usage"].values()), list(loads["waiting"].values())
        spare_kv = _mean([self.kv_threshold - u for u in usage])
        spare_queue = _mean([self.queue_threshold - w for w in waiting])
        state = {"spare_kv": spare_kv, "spare_queue": spare_queue}
        if spare_kv < self.kv_spare_trigger or spare_queue < self.queue_spare_trigger:
            return current + 1, state
        if current > 1 and self._spares_hold(sum(usage) / (current - 1), sum(waiting) / (current - 1)):
            return current - 1, state
        return current, state

    def _spares_hold(self, kv_usage: float, waiting: float) -> bool:
        """Whether one replica at this usage and queue keeps both spares at or above their triggers."""
        return (self.kv_threshold - kv_usage >= self.kv_spare_trigger
                and self.queue_threshold - waiting >= self.queue_spare_trigger)
