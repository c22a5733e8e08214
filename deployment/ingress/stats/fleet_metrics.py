"""/metrics for a fleet: every engine's Prometheus text with an `engine` label, plus fleet totals.

Each aggregator renders its own engine's text; here the texts are parsed and written again as one exposition
(one HELP/TYPE per family), each `kvfleet_*` sample labelled `engine="<engine id>"`. `vllm:*` samples keep the
`engine` label they already have (`<engine id>/<dp>`, one per dp group, aggregator/vllm_metrics.py). The fleet
totals are their own families (`kvfleet_fleet_*`), so `sum(kvfleet_...)` over the engines never counts them.
"""

from __future__ import annotations

import re
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from aggregator.fields import KV_STATS_COUNTERS, KV_STATS_GAUGES


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


# (name, type, help): the fleet totals, from the sum of the engines' kvCacheStats (deployment/ingress/stats/fleet.py)
FLEET_METRICS: list[tuple[str, str, str]] = [
    *[(f"kvfleet_fleet_kv_cache_{_snake(k)}_total", "counter", f"fleet cumulative {k}: the engines' sum")
      for k in KV_STATS_COUNTERS],
    *[(f"kvfleet_fleet_kv_cache_{_snake(k[:-len('NumBlocks')])}_blocks", "gauge", f"fleet {k}: the engines' sum")
      for k in KV_STATS_GAUGES],
    ("kvfleet_fleet_kv_cache_hit_rate", "gauge", "fleet reused / (reused + missed), from the summed counts"),
    ("kvfleet_fleet_engines", "gauge", "engines in the fleet"),
    ("kvfleet_fleet_engines_scraped", "gauge", "engines whose aggregator answered this scrape"),
]


def _fleet_families(fleet: dict[str, Any], engines: int, scraped: int) -> list[Metric]:
    values = {f"kvfleet_fleet_kv_cache_{_snake(k)}_total": fleet.get(k, 0) for k in KV_STATS_COUNTERS}
    values |= {f"kvfleet_fleet_kv_cache_{_snake(k[:-len('NumBlocks')])}_blocks": fleet.get(k, 0)
               for k in KV_STATS_GAUGES}
    values |= {"kvfleet_fleet_kv_cache_hit_rate": fleet.get("cacheHitRate", 0.0), "kvfleet_fleet_engines": engines,
               "kvfleet_fleet_engines_scraped": scraped}
    out: list[Metric] = []
    for name, kind, helptext in FLEET_METRICS:
        fam = (CounterMetricFamily(name[:-len("_total")], helptext) if kind == "counter"
               else GaugeMetricFamily(name, helptext))
        fam.add_metric([], values[name])
        out.append(fam)
    return out


def merge_metrics(texts: dict[str, str], fleet: dict[str, Any], engines: int) -> str:
    """One exposition from each engine's text (engine id -> text) and the fleet's summed kvCacheStats."""
    families: dict[str, Metric] = {}
    for eid, text in texts.items():
        for fam in text_string_to_metric_families(text):
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                labels = s.labels if "engine" in s.labels else {"engine": eid, **s.labels}
                out.samples.append(s._replace(labels=labels))
    merged = [*families.values(), *_fleet_families(fleet, engines, len(texts))]

    class _Collector:
        def collect(self):
            return merged

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry).decode()
