"""aggregator: merges every rank's KV cache stats deltas into one cluster-wide kvCacheIterationStats stream.

Layout: `fields` (SPEC field names), `layout` (reports as number rows), `merge` (pure merge rules),
`assembler` (pure: pending iterations, emission, late deltas, dedupe, acks), `buffer` (record ring), `actor`
(the StatsAggregator Ray actor), `outbox` (rank side), `metrics` (Prometheus text).

Scaling past one actor: one StatsAggregator's own Python work is ~40-60 us per rank message (flatten at
ingest, column-sum merge: layout.py), but through Ray it reaches only 50-80% of what a no-op actor takes
from the same batches, and on the 2-core build machine that ceiling is 4-11k messages/s
(bench/aggregator_bench.py prints both), i.e. a few hundred ranks at 20 iterations/s. Beyond that, a tree:
one aggregator per node merges its local ranks (the merge is associative: counters add, gauges and peaks of
different dp groups add, tp groups never span nodes when tp <= GPUs per node) and forwards one pre-merged
delta per iteration upward, shaped like a rank message whose `report` is the node's merged views and whose
`kv_cache_stats` is the node's cumulative sum; the top aggregator then sees N_nodes messages per iteration
instead of N_ranks, so its cost is O(nodes) and each node stage is O(ranks per node): the per-node stage
costs what the bench measures at 8 ranks. What a tree must add: the top-level tp rule becomes 'all counters
are final' (node messages carry tp_rank 0), a node's incomplete iteration is forwarded with its missing
ranks so the top record can name them, and the two timeouts nest (node timeout < top timeout) so a slow rank
does not make whole nodes look missing. That tree is described, not built.
"""

from .actor import StatsAggregator, StatsAggregatorImpl, aggregator_name, get_or_create_aggregator
from .outbox import RankOutbox
from .relay import StatsRelay, StatsRelayImpl, relay_name

__all__ = ["RankOutbox", "StatsAggregator", "StatsAggregatorImpl", "StatsRelay", "StatsRelayImpl", "aggregator_name",
           "get_or_create_aggregator", "relay_name"]
