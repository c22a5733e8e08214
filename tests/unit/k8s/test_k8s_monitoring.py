"""k8s/ rendered with kustomize, the PodMonitors, and the Grafana dashboard against the metrics we export."""

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.k8s_support import cluster_pods, selects
from tests.unit.k8s.test_k8s_manifests import (
    DASHBOARD,
    K8S,
    cluster_specs,
    crd_errors,
    docs_of_kind,
    k8s_validate,
    load_docs,
    ray_containers,
    rayservice,
)

VLLM_DASHBOARDS = [K8S / "monitoring" / "vllm_kv_cache.json", K8S / "monitoring" / "vllm_overview.json"]

# --- kustomize -------------------------------------------------------------------------------------------


def kustomize(root: Path = K8S) -> list[dict[str, Any]]:
    """`kubectl kustomize root` (k8s/ or an overlay of it), as documents."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip(f"kubectl not installed: cannot render {root.name}/ with kustomize")
    out = subprocess.run([kubectl, "kustomize", str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kustomize_renders_everything():
    """Every resource the kustomization lists comes out as written (YAML anchors expanded), the RayService
    passes the CRD, and the NetworkPolicies, the PodDisruptionBudget and Redis pass their core schemas."""
    docs = kustomize()
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    sources = [d for path in listed for d in load_docs(K8S / path)]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    rendered = {key(d): d for d in docs}
    dashboards = {"kvfleet-grafana-dashboard": ("kvfleet.json", DASHBOARD),
                  "kvfleet-vllm-kv-cache-dashboard": ("vllm_kv_cache.json", VLLM_DASHBOARDS[0]),
                  "kvfleet-vllm-overview-dashboard": ("vllm_overview.json", VLLM_DASHBOARDS[1])}
    assert sorted(rendered) == sorted([key(d) for d in sources] + [("ConfigMap", name) for name in dashboards])
    for doc in sources:
        assert rendered[key(doc)] == doc, key(doc)
    kinds = {d["kind"] for d in docs}
    assert {"RayService", "NetworkPolicy", "PodDisruptionBudget", "Deployment", "Service"} <= kinds
    assert crd_errors("RayService", rendered[("RayService", "kvfleet")]) == []
    for doc in docs:
        if doc["kind"] in {"NetworkPolicy", "PodDisruptionBudget", "Deployment", "Service", "PersistentVolumeClaim"}:
            k8s_validate(doc)
    for name, (key_name, path) in dashboards.items():
        dashboard_cm = rendered[("ConfigMap", name)]
        k8s_validate(dashboard_cm)
        assert dashboard_cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard_cm["data"][key_name]) == json.loads(path.read_text())


def monitors() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"] for _, d in docs_of_kind("PodMonitor")}


def app_pods() -> dict[str, dict[str, str]]:
    """The pods of the app during a NewCluster upgrade (two RayService clusters) with kvfleet-dev beside it."""
    (_, dev), = docs_of_kind("RayCluster")
    service = rayservice()["spec"]["rayClusterConfig"]
    pods = {}
    for cluster, spec in [("kvfleet-x7k2p", service), ("kvfleet-q9m4w", service), ("kvfleet-dev", dev["spec"])]:
        pods.update({f"{cluster}/{kind}": labels for kind, labels in cluster_pods(spec, cluster).items()})
    return pods


def test_kvfleet_podmonitor_scrapes_every_head_pod_once():
    """Every head pod of the app (old and new cluster of an upgrade, kvfleet-dev): one scrape per Ray cluster,
    since each cluster's proxies all return that cluster's view. Not the workers (a second copy of the same
    series) and not KubeRay's Redis cleanup pod (built from the head's template, so it has its labels)."""
    selector = monitors()["kvfleet"]["selector"]
    scraped = sorted(name for name, labels in app_pods().items() if selects(selector, labels))
    assert scraped == ["kvfleet-dev/head", "kvfleet-q9m4w/head", "kvfleet-x7k2p/head"]


def test_kvfleet_ray_podmonitor_scrapes_every_ray_node():
    selector = monitors()["kvfleet-ray"]["selector"]
    scraped = {name for name, labels in app_pods().items() if selects(selector, labels)}
    assert scraped == {name for name in app_pods() if not name.endswith("/redis-cleanup")}


def test_podmonitors_label_series_with_their_ray_cluster_and_scrape_named_ports():
    ports = {}
    for _, spec in cluster_specs():
        for group, container in ray_containers(spec):
            ports.setdefault(group, []).append({p["name"] for p in container["ports"]})
    kvfleet = monitors()["kvfleet"]["podMetricsEndpoints"]
    assert [e["path"] for e in kvfleet] == ["/metrics"]
    assert all(kvfleet[0]["port"] in names for names in ports["head"])
    for endpoint in monitors()["kvfleet-ray"]["podMetricsEndpoints"]:
        assert all(endpoint["port"] in names for group in ports.values() for names in group)
    for name, spec in monitors().items():
        for endpoint in spec["podMetricsEndpoints"]:
            assert {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
                    "targetLabel": "ray_io_cluster"} in endpoint["relabelings"], name


# The parts of prometheus-operator's PodMonitor schema (monitoring.coreos.com/v1) these manifests use, written
# from its CRD so a misspelt field fails here instead of being pruned by the API server.
SECRET_KEY_SELECTOR = {"type": "object", "required": ["key"], "additionalProperties": False,
                       "properties": {"name": {"type": "string"}, "key": {"type": "string"},
                                      "optional": {"type": "boolean"}}}
RELABEL_CONFIG = {"type": "object", "additionalProperties": False, "properties": {
    "sourceLabels": {"type": "array", "items": {"type": "string"}}, "separator": {"type": "string"},
    "targetLabel": {"type": "string"}, "regex": {"type": "string"}, "modulus": {"type": "integer"},
    "replacement": {"type": "string"}, "action": {"type": "string"}}}
LABEL_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"], "additionalProperties": False,
        "properties": {"key": {"type": "string"}, "operator": {"type": "string"},
                       "values": {"type": "array", "items": {"type": "string"}}}}}}}
POD_METRICS_ENDPOINT = {"type": "object", "additionalProperties": False, "properties": {
    "port": {"type": "string"}, "path": {"type": "string"}, "interval": {"type": "string"},
    "scrapeTimeout": {"type": "string"}, "scheme": {"type": "string"},
    "authorization": {"type": "object", "additionalProperties": False, "properties": {
        "type": {"type": "string"}, "credentials": SECRET_KEY_SELECTOR}},
    "relabelings": {"type": "array", "items": RELABEL_CONFIG},
    "metricRelabelings": {"type": "array", "items": RELABEL_CONFIG}}}
POD_MONITOR = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
    "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
    "spec": {"type": "object", "required": ["selector"], "additionalProperties": False, "properties": {
        "selector": LABEL_SELECTOR, "jobLabel": {"type": "string"},
        "podMetricsEndpoints": {"type": "array", "items": POD_METRICS_ENDPOINT}}}}}


def podmonitor_errors(doc: dict[str, Any]) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    return [e.message for e in jsonschema.Draft7Validator(POD_MONITOR).iter_errors(doc)]


def test_podmonitors_match_prometheus_operator_schema():
    docs = docs_of_kind("PodMonitor")
    assert len(docs) == 2
    for name, doc in docs:
        assert podmonitor_errors(doc) == [], name
    bad = copy.deepcopy(docs[0][1])
    bad["spec"]["podMetricsEndpoints"][0]["authorization"]["credential"] = {"name": "x", "key": "y"}
    assert podmonitor_errors(bad)


# --- Grafana dashboard -----------------------------------------------------------------------------------


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


SAMPLE_SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def exported_metric_names() -> set[str]:
    """Every sample name aggregator/metrics.py can expose."""
    metrics = pytest.importorskip("aggregator.metrics", reason="aggregator/metrics.py not written yet")
    return {name for name, *_ in metrics.METRICS}


def test_dashboard_uses_only_exported_metrics():
    exprs = dashboard_exprs()
    assert exprs and all(e.strip() for e in exprs)
    used = {m for e in exprs for m in re.findall(r"\bkvfleet_[a-z0-9_]+", e)}
    assert used
    known = exported_metric_names()
    unknown = {m for m in used if m not in known and not any(
        m.endswith(s) and m.removesuffix(s) in known for s in SAMPLE_SUFFIXES)}
    assert not unknown, f"dashboard uses metrics the aggregator does not export: {sorted(unknown)}"


SERIES_SELECTOR = re.compile(r"\b(kvfleet_[a-z0-9_]+)(\{[^}]*\})?")


def test_dashboard_shows_one_ray_cluster_at_a_time():
    """During an upgrade (or beside kvfleet-dev) several clusters export the same series: every series in
    every panel is filtered on the single-valued `cluster` variable, over the label the PodMonitor sets."""
    dashboard = json.loads(DASHBOARD.read_text())
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "cluster"]
    assert var["type"] == "query" and not var["multi"] and not var["includeAll"]
    assert re.fullmatch(r"label_values\(kvfleet_\w+, ray_io_cluster\)", var["definition"])
    assert var["query"]["query"] == var["definition"]
    for expr in dashboard_exprs():
        for name, matchers in SERIES_SELECTOR.findall(expr):
            assert 'ray_io_cluster="$cluster"' in matchers, f"{name} in {expr!r} is not filtered on the cluster"


def test_dashboard_has_the_panels_the_issue_asks_for():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for needle in ("hit rate", "blocks", "onboard", "offload", "per rank"):
        assert needle in titles, needle
    assert {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p} == {"${datasource}"}
