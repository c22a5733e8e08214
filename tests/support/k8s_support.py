"""What the k8s tests need to reason about pods that only exist once KubeRay runs: the labels KubeRay gives
the pods it creates, label selectors, and NetworkPolicy ingress rules.

The label rules follow KubeRay's `labelPod` (ray-operator/controllers/ray/common/pod.go): the pod template's
labels, then ray.io/node-type, ray.io/cluster and ray.io/group, which the template cannot override. A
RayService names each of its clusters `<name>-<5 random characters>`, so an upgrade has two clusters of the
same app; KubeRay's Redis cleanup Job is built from the head pod with node-type `redis-cleanup`.
"""

from typing import Any

APP_NAMESPACE = "kvfleet"


def kuberay_pod_labels(template: dict[str, Any], cluster: str, node_type: str, group: str) -> dict[str, str]:
    labels = {"ray.io/is-ray-node": "yes", "app.kubernetes.io/name": "kuberay",
              "app.kubernetes.io/created-by": "kuberay-operator", "ray.io/identifier": f"{cluster}-{node_type}"}
    labels.update(template.get("metadata", {}).get("labels", {}))
    labels.update({"ray.io/node-type": node_type, "ray.io/cluster": cluster, "ray.io/group": group})
    return labels


def cluster_pods(spec: dict[str, Any], cluster: str) -> dict[str, dict[str, str]]:
    """Labels of the pods KubeRay creates for one RayCluster spec: `head`, each worker group, and the Redis
    cleanup Job's pod (`redis-cleanup`, only when the cluster has GCS fault tolerance)."""
    head = spec["headGroupSpec"]["template"]
    pods = {"head": kuberay_pod_labels(head, cluster, "head", "headgroup")}
    for group in spec.get("workerGroupSpecs", []):
        pods[group["groupName"]] = kuberay_pod_labels(group["template"], cluster, "worker", group["groupName"])
    if "gcsFaultToleranceOptions" in spec:
        pods["redis-cleanup"] = kuberay_pod_labels(head, cluster, "redis-cleanup", "headgroup")
    return pods


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against a set of labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def namespace_labels(namespace: str, labels: dict[str, str] | None = None) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace, **(labels or {})}


def peer_allowed(peer: dict[str, Any], source: dict[str, Any]) -> bool:
    """One `from` entry of a NetworkPolicy against a peer {labels, namespace, namespace_labels}."""
    pod_sel, ns_sel = source.get("podSelector"), source.get("namespaceSelector")
    if ns_sel is None and pod_sel is not None:  # a podSelector alone means the policy's own namespace
        return peer["namespace"] == APP_NAMESPACE and selects(pod_sel, peer["labels"])
    ns_ok = selects(ns_sel, peer["namespace_labels"])
    return ns_ok and (pod_sel is None or selects(pod_sel, peer["labels"]))


def ingress_allowed(policy: dict[str, Any], peer: dict[str, Any], port: int) -> bool:
    """Whether one NetworkPolicy (which selects the target pod) admits TCP `port` from `peer`."""
    for rule in policy["spec"].get("ingress", []):
        sources = rule.get("from")
        ports = rule.get("ports")
        if ports is not None and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP"
                                         for p in ports):
            continue
        if sources is None or any(peer_allowed(peer, s) for s in sources):
            return True
    return False


def peer(labels: dict[str, str], namespace: str = APP_NAMESPACE,
         ns_labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"labels": labels, "namespace": namespace, "namespace_labels": namespace_labels(namespace, ns_labels)}
