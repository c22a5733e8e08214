"""k8s/ rendered with kustomize, the PodMonitors, and the Grafana dashboard against the metrics we export."""

import json
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.test_k8s_manifests import (
    DASHBOARD,
    K8S,
    cluster_specs,
    crd_errors,
    docs_of_kind,
    k8s_validate,
    ray_containers,
    rayservice,
)

# --- kustomize -------------------------------------------------------------------------------------------


def kustomize() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: cannot render k8s/ with kustomize")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kustomize_renders_everything():
    docs = kustomize()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "PodMonitor", "PodMonitor", "RayService"]
    (rendered,) = [d for d in docs if d["kind"] == "RayService"]
    assert rendered == rayservice()
    assert crd_errors("RayService", rendered) == []
    (dashboard_cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    k8s_validate(dashboard_cm)
    assert dashboard_cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard_cm["data"]["kvfleet.json"]) == json.loads(DASHBOARD.read_text())


def test_podmonitors_select_the_ray_pods_and_scrape_named_ports():
    ports = {}
    for _, spec in cluster_specs()[1:]:  # the RayService's cluster
        for group, container in ray_containers(spec):
            ports[group] = {p["name"] for p in container["ports"]}
    head_labels = rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    monitors = {d["metadata"]["name"]: d for _, d in docs_of_kind("PodMonitor")}
    kvfleet = monitors["kvfleet"]["spec"]
    assert kvfleet["selector"]["matchLabels"].items() <= head_labels.items()
    assert [e["path"] for e in kvfleet["podMetricsEndpoints"]] == ["/metrics"]
    assert kvfleet["podMetricsEndpoints"][0]["port"] in ports["head"]
    for endpoint in monitors["kvfleet-ray"]["spec"]["podMetricsEndpoints"]:
        assert all(endpoint["port"] in names for names in ports.values())


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


def test_dashboard_has_the_panels_the_issue_asks_for():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for needle in ("hit rate", "blocks", "onboard", "offload", "per rank"):
        assert needle in titles, needle
    assert {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p} == {"${datasource}"}
