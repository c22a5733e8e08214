"""aggregator: one engine's cluster-wide KV cache statistics, merged from every rank's per-iteration delta.

Modules, lowest first:
- `fields`: the spec's field names and which view carries which.
- `delta`: what crosses actor boundaries: a rank's `RankLayout` (once per incarnation), its `RankDelta`
  (one packed int64 row per iteration) and the engine's `Iteration` (every delta of one step).
- `merge`: the merge rules of one iteration (tp dedup, dp sums, tpDivergence), pure.
- `assembler`: records from iterations: dedupe, cumulative totals, the TensorRT-LLM fields, checkpoint state.
- `buffer`: the ring of records readers page through; `metrics`: Prometheus text.
- `messages`: the actor's typed replies (`Ack`, `AggregatorHealth`, `RankHealth`).
- `actor`: the `StatsAggregator` Ray actor (ingest, readers, restart from its checkpoint).

A delta's path: a rank's `step()` returns it with its step result; the engine forwards each iteration's
deltas in one `ingest` call (one in flight) and keeps them until acknowledged.
"""

from aggregator.actor import (
           StaleSession,
           StatsAggregator,
           StatsAggregatorImpl,
           aggregator_name,
           get_or_create_aggregator,
)
from aggregator.delta import Iteration, RankDelta, RankLayout

__all__ = ["Iteration", "RankDelta", "RankLayout", "StaleSession", "StatsAggregator", "StatsAggregatorImpl",
           "aggregator_name", "get_or_create_aggregator"]
