"""aggregator: merges every rank's KV cache stats deltas into one cluster-wide kvCacheIterationStats stream.

Layout: `fields` (SPEC field names), `layout` (the packed wire form: a report as a layout string and int64
rows), `merge` (pure merge rules), `assembler` (pure: pending iterations, emission, late deltas, dedupe,
acks), `buffer` (record ring), `actor` (the StatsAggregator Ray actor), `outbox` (rank side), `relay` (one
per node, between the ranks and the aggregator), `metrics` (Prometheus text).

Path of a rank's delta: RankOutbox (in the rank; keeps it until acknowledged) -> its node's StatsRelay (one
call per rank per iteration) -> StatsAggregator (one call per node per flush, a pickled batch of packed
messages) -> records. What one aggregator costs (bench/aggregator_bench.py, 2-core build machine): Ray's
fixed ~1 ms of actor CPU per call, plus ~20-45 us per message (about 10 to unpickle, the rest validating,
deduping and merging: ~210 Python opcodes per message in 1024-message batches at 64 ranks). So it takes
20-36k messages/s when batches are large, which the relays produce by themselves: a relay keeps one call
in flight, so its batches grow exactly when the aggregator is busy.

Scaling past one actor, a tree: the relays are its first stage, but they only batch. The next step is
to make each node stage merge as well: one aggregator per node merges its local ranks (the merge is
associative: counters add, gauges and peaks of different dp groups add, tp groups never span nodes when
tp <= GPUs per node) and forwards one pre-merged delta per iteration, shaped like a rank message whose rows
are the node's sums and whose `kv_cache_stats` is the node's cumulative sum; the top aggregator then sees
N_nodes messages per iteration instead of N_ranks, O(nodes) work per iteration, and each node stage is
O(ranks per node), which the bench's 8-rank rows measure. What that adds: at the top the tp rule becomes
'all counters are final' (node messages carry tp_rank 0), a node's incomplete iteration is forwarded with
its missing ranks so the top record can name them, per-rank records stay on the nodes (the top keeps
node records), and the two timeouts nest (node timeout < top timeout) so a slow rank does not make a
whole node look missing. That merging stage is described, not built.
"""

from .actor import StatsAggregator, StatsAggregatorImpl, aggregator_name, get_or_create_aggregator
from .outbox import RankOutbox
from .relay import StatsRelay, StatsRelayImpl, relay_name

__all__ = ["RankOutbox", "StatsAggregator", "StatsAggregatorImpl", "StatsRelay", "StatsRelayImpl", "aggregator_name",
           "get_or_create_aggregator", "relay_name"]
