"""k8s-multi-pod/, the multi-pod overlay of k8s/ (k8s/README.md, "Across several nodes"), rendered with kustomize
and checked as the base is: it changes only the RayService and the PodDisruptionBudget, validates against
KubeRay's CRD and the core schemas, keeps the Serve replicas and the aggregator on a CPU `control` group (never
the head, never the GPU pods), and sizes the rank-only GPU pods to whole tp groups and the whole engine.
"""

import functools
from pathlib import Path
from typing import Any

import yaml

from tests.support.k8s_support import cluster_pods, peer, selects
from tests.unit.k8s.test_k8s_hardening import RAY_PORTS, admitted, container_problems
from tests.unit.k8s.test_k8s_manifests import (
    K8S,
    REPO,
    as_pod,
    control_resource,
    crd_errors,
    gpu_count,
    k8s_validate,
    kvfleet_env,
    plain_env,
    serve_config,
)
from tests.unit.k8s.test_k8s_monitoring import kustomize

OVERLAY = REPO / "k8s-multi-pod"
PROBES = ("readinessProbe", "livenessProbe", "startupProbe")


@functools.cache
def rendered(root: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in kustomize(root)}


def overlay() -> dict[tuple[str, str], dict[str, Any]]:
    return rendered(OVERLAY)


def cluster() -> dict[str, Any]:
    return overlay()[("RayService", "kvfleet")]["spec"]["rayClusterConfig"]


def groups() -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in cluster()["workerGroupSpecs"]}


def container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def overlay_serve_config() -> dict[str, Any]:
    return yaml.safe_load(overlay()[("RayService", "kvfleet")]["spec"]["serveConfigV2"])


def settings():
    from deployment.settings import Settings

    env = kvfleet_env(overlay_serve_config())
    return Settings(**{k.removeprefix("KVFLEET_").lower(): v for k, v in env.items()})


def test_overlay_patches_only_the_rayservice_and_the_pdb():
    base = rendered(K8S)
    pdb = ("PodDisruptionBudget", "kvfleet-gpu-worker")
    assert overlay().keys() == base.keys() - {pdb} | {("PodDisruptionBudget", "kvfleet-control")}
    changed = {key for key in base if key != pdb and overlay()[key] != base[key]}
    assert changed == {("RayService", "kvfleet")}


def test_overlay_validates_against_the_crd_and_the_core_schemas():
    assert crd_errors("RayService", overlay()[("RayService", "kvfleet")]) == []
    templates = [cluster()["headGroupSpec"]["template"]] + [g["template"] for g in groups().values()]
    for i, template in enumerate(templates):
        k8s_validate(as_pod(f"pod-{i}", template))
    k8s_validate(overlay()[("PodDisruptionBudget", "kvfleet-control")])


def test_head_advertises_no_kvfleet_control_and_requests_no_gpu():
    head = cluster()["headGroupSpec"]
    assert control_resource(head) == 0, "a head restart must not take the replicas"
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"
    assert gpu_count(container(head)) == 0


def test_only_the_control_group_advertises_kvfleet_control_and_it_has_no_gpu():
    assert {name for name, g in groups().items() if control_resource(g) > 0} == {"control"}
    control = groups()["control"]
    assert 1 <= control["minReplicas"] <= control["replicas"] <= control["maxReplicas"] <= 2
    assert gpu_count(container(control)) == 0 and control["rayStartParams"]["num-gpus"] == "0"
    assert plain_env(container(control))["NVIDIA_VISIBLE_DEVICES"] == "void"
    # both replicas may land on one control pod (the aggregator asks for no CPU)
    deployments = overlay_serve_config()["applications"][0]["deployments"]
    replica_cpus = sum(d["ray_actor_options"]["num_cpus"] for d in deployments)
    assert int(container(control)["resources"]["limits"]["cpu"]) >= replica_cpus
    # the head's image, env (API keys from the Secret, drain timeout) and securityContext, copied by the patch
    head = cluster()["headGroupSpec"]["template"]
    for key in ("image", "env", "securityContext"):
        assert container(control)[key] == head["spec"]["containers"][0][key], key
    assert control["template"]["spec"]["securityContext"] == head["spec"]["securityContext"]
    assert control["template"]["spec"]["terminationGracePeriodSeconds"] == head["spec"]["terminationGracePeriodSeconds"]
    assert container_problems(container(control)) == []


def test_gpu_pods_hold_whole_tp_groups_and_together_the_engine():
    s = settings()
    gpu_groups = {name: g for name, g in groups().items() if gpu_count(container(g)) > 0}
    assert "gpu" in gpu_groups and "control" not in gpu_groups
    total = least = most = 0
    for name, group in gpu_groups.items():
        per_pod = gpu_count(container(group))
        assert per_pod % s.tp == 0, f"{name}: a tp group is packed on one pod (STRICT_PACK)"
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
        assert int(container(group)["resources"]["limits"]["cpu"]) >= per_pod * s.num_cpus_per_rank, name
        total += group["replicas"] * per_pod
        least += group["minReplicas"] * per_pod
        most += group["maxReplicas"] * per_pod
    ranks = s.dp * s.tp  # one engine replica's, one GPU each
    assert total == s.engine_replicas * ranks, "one rank per GPU at deploy"
    # the Ray autoscaler adds pods up to maxReplicas for the replicas Serve adds (test_k8s_autoscaling.py)
    assert s.autoscaling and least >= s.engine_replicas_min * ranks and most >= s.engine_replicas_max * ranks
    assert sum(g["replicas"] for g in gpu_groups.values()) > 1, "a multi-pod engine"


def test_control_pods_hold_every_serve_replica_of_the_largest_fleet():
    """The control group is not autoscaled: its CPUs fit the ingress and engine_replicas_max engine replicas."""
    s = settings()
    control = groups()["control"]
    assert control["minReplicas"] == control["replicas"] == control["maxReplicas"]
    deployments = overlay_serve_config()["applications"][0]["deployments"]
    cpus = {d["name"]: d["ray_actor_options"]["num_cpus"] for d in deployments}
    need = cpus["KVFleetIngress"] * s.ingress_replicas + cpus["KVFleetEngine"] * s.most_engines
    assert control["minReplicas"] * int(container(control)["resources"]["limits"]["cpu"]) >= need


def test_serve_config_is_the_bases_resized_with_the_replicas_on_kvfleet_control():
    from ray.serve.schema import ServeDeploySchema

    ours = overlay_serve_config()
    ServeDeploySchema.model_validate(ours)
    env = kvfleet_env(ours)
    assert env["KVFLEET_INGRESS_RESOURCE"] == env["KVFLEET_ENGINE_RESOURCE"] == "kvfleet_control"
    for d in ours["applications"][0]["deployments"]:
        assert d["ray_actor_options"]["resources"] == {"kvfleet_control": 0.001}, d["name"]
    # everything but the sizing is the base's (whose drift from `serve build` test_k8s_manifests checks)
    base = serve_config()
    for config in (ours, base):
        for key in ("KVFLEET_DP", "KVFLEET_TP"):
            del kvfleet_env(config)[key]
    assert ours == base


def test_every_pod_keeps_kuberays_probes_so_rank_only_pods_stay_out_of_the_serve_service():
    """The GPU pods run no Serve replica and so no proxy: with KubeRay's RayService-worker probe they stay
    unready, out of kvfleet-serve-svc, which would otherwise send clients to their empty port 8000."""
    for c in (container(cluster()["headGroupSpec"]), container(groups()["control"]), container(groups()["gpu"])):
        assert not set(PROBES) & c.keys()
    assert {"name": "serve", "containerPort": 8000} in container(groups()["control"])["ports"]


def test_pdb_holds_the_control_pods_that_run_the_engine_replica():
    pdb = overlay()[("PodDisruptionBudget", "kvfleet-control")]["spec"]
    assert pdb["maxUnavailable"] == 0
    pods = cluster_pods(cluster(), "kvfleet-x7k2p")
    assert {name for name, labels in pods.items() if selects(pdb["selector"], labels)} == {"control"}


def test_control_pods_are_ray_peers_and_scraped():
    pods = cluster_pods(cluster(), "kvfleet-x7k2p")
    policy = overlay()[("NetworkPolicy", "kvfleet-ray")]
    assert selects(policy["spec"]["podSelector"], pods["control"])
    assert admitted(policy, peer(pods["control"])) == set(RAY_PORTS)
    monitor = overlay()[("PodMonitor", "kvfleet-ray")]["spec"]
    assert selects(monitor["selector"], pods["control"]) and selects(monitor["selector"], pods["gpu"])
