"""Autoscaling on KubeRay (k8s/README.md, "Autoscaling"): Serve scales the engine replicas between
KVFLEET_ENGINE_REPLICAS_MIN and _MAX (the code's autoscaling_config, from the settings), and KubeRay's in-tree Ray
autoscaler adds and removes GPU worker pods for their ranks. Read from the manifests, as the other k8s tests:
in-tree autoscaling on with options KubeRay's CRD accepts and a locked-down sidecar, the settings parsing into
Serve's bounds, the gpu group's bounds holding the fewest and the most replicas' ranks, the autoscaler's idle
timeout against Serve's downscale delay, the PodDisruptionBudget against the group's floor, and the README's
policy override passing Ray's schema.
"""

import copy
import importlib
import re
import warnings
from typing import Any

import pytest
import yaml

from tests.unit.k8s.test_k8s_hardening import container_problems
from tests.unit.k8s.test_k8s_manifests import (
    CRDS,
    K8S,
    RAY_KINDS,
    as_pod,
    crd_errors,
    docs_of_kind,
    gpu_count,
    k8s_validate,
    kvfleet_env,
    load_docs,
    plain_env,
    serve_config,
    settings_from_env,
)

KV_POLICY = "deployment.autoscale:KVAutoscalingPolicy"


def ray_resources() -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(kind, file, document, RayCluster spec) for the RayService and the RayCluster."""
    out = []
    for kind in sorted(RAY_KINDS):
        for name, doc in docs_of_kind(kind):
            out.append((kind, name, doc, doc["spec"]["rayClusterConfig"] if kind == "RayService" else doc["spec"]))
    return out


def cluster_settings(kind: str, spec: dict[str, Any]):
    """The settings the cluster's app runs with: the RayService's serveConfigV2 env, the RayCluster's containers'
    (test_k8s_manifests checks the two are the same)."""
    if kind == "RayService":
        return settings_from_env(kvfleet_env(serve_config()))
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    return settings_from_env({k: v for k, v in plain_env(head).items() if k.startswith("KVFLEET_")})


def container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def gpu_groups(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [g for g in spec["workerGroupSpecs"] if gpu_count(container(g)) > 0]


def engine_entry(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = config["applications"]
    return next(d for d in app["deployments"] if d["name"] == "KVFleetEngine")


# --- KubeRay's autoscaler ----------------------------------------------------------------------------------


def crd_autoscaler_options() -> dict[str, Any]:
    if not CRDS.is_dir():
        pytest.skip(f"KubeRay CRDs not found at {CRDS} (shared data, not part of the repo)")
    (crd,) = load_docs(CRDS / RAY_KINDS["RayCluster"])
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["autoscalerOptions"]


def test_in_tree_autoscaling_is_on_with_options_the_crd_accepts():
    modes = crd_autoscaler_options()["properties"]["upscalingMode"]["enum"]
    resources = ray_resources()
    assert {kind for kind, *_ in resources} == set(RAY_KINDS)
    for kind, name, doc, spec in resources:
        assert spec["enableInTreeAutoscaling"] is True, name
        options = spec["autoscalerOptions"]
        assert options["upscalingMode"] in modes, name
        assert isinstance(options["idleTimeoutSeconds"], int) and options["idleTimeoutSeconds"] > 0, name
        # the autoscaler version follows rayVersion (v2 since Ray 2.47); set by hand, KubeRay also makes the
        # head pod's restartPolicy Never
        assert "version" not in options, name
        assert crd_errors(kind, doc) == [], name


def test_crd_validation_bites_on_autoscaler_options():
    (_, _, doc, _), = [r for r in ray_resources() if r[0] == "RayService"]

    def options_errors(change) -> list[str]:
        bad = copy.deepcopy(doc)
        change(bad["spec"]["rayClusterConfig"]["autoscalerOptions"])
        return crd_errors("RayService", bad)

    assert options_errors(lambda o: o.update(upscalingMode="Fast"))
    assert options_errors(lambda o: o.update(idleTimeoutSeconds="60"))
    assert any("idleTimeoutSecond" in e for e in options_errors(lambda o: o.update(idleTimeoutSecond=60)))


def autoscaler_container(spec: dict[str, Any]) -> dict[str, Any]:
    """The sidecar KubeRay adds to the head pod (BuildAutoscalerContainer + mergeAutoscalerOverrides in its
    pod.go): the head's image, its command, and the options' env, resources and securityContext."""
    options = spec["autoscalerOptions"]
    head = container(spec["headGroupSpec"])
    sidecar = {"name": "autoscaler", "image": options.get("image", head["image"]),
               "imagePullPolicy": options.get("imagePullPolicy", "IfNotPresent"),
               "command": ["/bin/bash", "-c", "--"],
               "args": ["ray kuberay-autoscaler --cluster-name $(RAY_CLUSTER_NAME) "
                        "--cluster-namespace $(RAY_CLUSTER_NAMESPACE)"],
               "env": options.get("env", []), "resources": options["resources"]}
    if "securityContext" in options:
        sidecar["securityContext"] = options["securityContext"]
    return sidecar


def test_the_autoscaler_sidecar_is_locked_down_sized_and_a_valid_container():
    """Without a securityContext in autoscalerOptions KubeRay's sidecar has none, and the head pod would fail a
    restricted Pod Security admission; its env, resources and the pod it joins pass the core schemas."""
    for _, name, _, spec in ray_resources():
        sidecar = autoscaler_container(spec)
        assert container_problems(sidecar) == [], name
        res = sidecar["resources"]
        for key in ("cpu", "memory"):
            assert res["requests"][key] == res["limits"][key], (name, key)
        assert "ephemeral-storage" in res["requests"], name  # Ray's logs under /tmp/ray
        assert {e["name"]: e.get("value") for e in sidecar["env"]}.get("NVIDIA_VISIBLE_DEVICES") == "void", name
        # KubeRay injects the cluster's token (RAY_AUTH_*) into the sidecar; set by hand they would win
        assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & {e["name"] for e in sidecar["env"]}, name
        head = copy.deepcopy(spec["headGroupSpec"]["template"])
        head["spec"]["containers"].append(sidecar)
        k8s_validate(as_pod("head-with-autoscaler", head))
    assert container_problems({"name": "autoscaler", "securityContext": {}})  # the check bites


# --- Serve's bounds ----------------------------------------------------------------------------------------


def test_the_replica_settings_parse_and_give_serves_bounds():
    env = kvfleet_env(serve_config())
    assert {"KVFLEET_ENGINE_REPLICAS", "KVFLEET_ENGINE_REPLICAS_MIN", "KVFLEET_ENGINE_REPLICAS_MAX"} <= env.keys()
    s = settings_from_env(env)
    assert s.autoscaling and s.autoscaling_policy == "kv"
    assert 1 <= s.engine_replicas_min <= s.engine_replicas <= s.engine_replicas_max
    assert s.engine_replicas_max > s.engine_replicas_min, "a fleet that can grow"
    # the code, not the config, sets the engine deployment's replicas: the config only may override the policy
    assert "num_replicas" not in engine_entry(serve_config())

    build = importlib.import_module("deployment.build")
    if not hasattr(build, "autoscaling_config"):
        pytest.skip("deployment.build.autoscaling_config(settings) does not exist yet: the settings parse, "
                    "but Serve's bounds built from them are not checked")
    config = build.autoscaling_config(s)
    assert (config.min_replicas, config.initial_replicas, config.max_replicas) == (
        s.engine_replicas_min, s.engine_replicas, s.engine_replicas_max)
    assert config.upscale_delay_s == s.autoscale_upscale_delay_s
    assert config.downscale_delay_s == s.autoscale_downscale_delay_s
    assert config.look_back_period_s == s.autoscale_look_back_s
    assert config.policy.policy_function == KV_POLICY
    # KVFLEET_ENGINE_REPLICAS_MAX "0" (README: a fixed fleet) turns Serve's autoscaling off
    assert build.autoscaling_config(settings_from_env({**env, "KVFLEET_ENGINE_REPLICAS_MAX": "0"})) is None


# --- the GPU pods ------------------------------------------------------------------------------------------


def test_the_gpu_group_holds_the_fewest_and_the_most_replicas_ranks():
    """One pod per engine replica's ranks (one GPU each): minReplicas pods hold engine_replicas_min replicas,
    maxReplicas pods engine_replicas_max (a replica beyond them would stay pending; a pod more would never be
    asked for), the pods at deploy engine_replicas; and the pods' CPUs take the ranks and the Serve replicas."""
    deployments = {d["name"]: d["ray_actor_options"]["num_cpus"]
                   for d in serve_config()["applications"][0]["deployments"]}
    for kind, name, _, spec in ray_resources():
        s = cluster_settings(kind, spec)
        ranks = s.dp * s.tp
        (group,) = gpu_groups(spec)
        per_pod = gpu_count(container(group))
        assert per_pod == ranks, f"{name}: one engine replica's ranks per pod"
        assert group["minReplicas"] * per_pod == s.engine_replicas_min * ranks, name
        assert group["replicas"] * per_pod == s.engine_replicas * ranks, name
        assert group["maxReplicas"] * per_pod == s.engine_replicas_max * ranks, name
        assert group["minReplicas"] >= 1, f"{name}: the autoscaler must not take the fleet's last pod"
        cpus = int(container(group)["resources"]["limits"]["cpu"])
        assert cpus >= ranks * s.num_cpus_per_rank + deployments["KVFleetEngine"], name
        need = (s.engine_replicas_max * (ranks * s.num_cpus_per_rank + deployments["KVFleetEngine"])
                + s.ingress_replicas * deployments["KVFleetIngress"])
        assert group["maxReplicas"] * cpus >= need, f"{name}: the largest fleet's CPUs"


def test_an_idle_gpu_pod_outlives_serves_downscale_delay():
    """A pod comes back in minutes (node, image, model), a replica's scale-down waits
    autoscale_downscale_delay_s: the pod a scale-down freed is kept at least as long."""
    for kind, name, _, spec in ray_resources():
        s = cluster_settings(kind, spec)
        assert spec["autoscalerOptions"]["idleTimeoutSeconds"] >= s.autoscale_downscale_delay_s, name


def test_the_disruption_budget_keeps_the_fewest_replicas_pods_and_no_more():
    """Drains keep the pods engine_replicas_min replicas need; a budget above the group's floor would hold
    every drain of an autoscaled pod."""
    (_, pdb), = docs_of_kind("PodDisruptionBudget")
    (_, _, _, spec), = [r for r in ray_resources() if r[0] == "RayService"]
    s = cluster_settings("RayService", spec)
    (group,) = gpu_groups(spec)
    keep = pdb["spec"]["minAvailable"]
    assert "maxUnavailable" not in pdb["spec"]
    assert keep * gpu_count(container(group)) >= s.engine_replicas_min * s.dp * s.tp
    assert keep <= group["minReplicas"]


# --- overriding the policy ---------------------------------------------------------------------------------


def check_autoscaling_override(entry: dict[str, Any], s) -> None:
    """An autoscaling_config written in serveConfigV2's KVFleetEngine entry: Serve's config (Ray's schema), with
    the settings' replica bounds (the engine ids and the fleet router follow the settings)."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    config = serve_config()
    engine_entry(config).update(copy.deepcopy(entry))
    with warnings.catch_warnings():
        # what Ray says "will raise an exception in a future release" (a look-back not above metrics_interval_s,
        # whose default is 10 s where the settings' push interval is 1 s) fails here now
        warnings.simplefilter("error", FutureWarning)
        ServeDeploySchema.model_validate(config)
        scaling = AutoscalingConfig(**entry["autoscaling_config"])
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (
        s.engine_replicas_min, s.engine_replicas, s.engine_replicas_max)
    assert "num_replicas" not in entry, "Serve refuses num_replicas beside autoscaling_config"
    policy = scaling.policy.policy_function
    if isinstance(policy, str) and ":" in policy:
        module, attr = policy.split(":")
        assert hasattr(importlib.import_module(module), attr), policy


def readme_override() -> dict[str, Any]:
    text = (K8S / "README.md").read_text()
    section = text[text.index("### Autoscaling"):]
    section = section[:section.index("\n## ")]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    (entry,) = yaml.safe_load(block)
    return entry


def test_the_readme_policy_override_is_a_valid_serve_config_with_the_settings_bounds():
    entry = readme_override()
    assert entry["name"] == "KVFleetEngine" and set(entry) == {"name", "autoscaling_config"}
    assert entry["autoscaling_config"]["policy"]["policy_function"] == KV_POLICY
    check_autoscaling_override(entry, settings_from_env(kvfleet_env(serve_config())))
    wrong = copy.deepcopy(entry)
    wrong["autoscaling_config"]["max_replicas"] += 1
    with pytest.raises(AssertionError):
        check_autoscaling_override(wrong, settings_from_env(kvfleet_env(serve_config())))


def test_an_override_in_the_manifest_keeps_the_settings_bounds():
    entry = engine_entry(serve_config())
    if "autoscaling_config" not in entry:
        return  # the code's autoscaling_config, from the settings (checked above)
    check_autoscaling_override({"name": entry["name"], "autoscaling_config": entry["autoscaling_config"]},
                               settings_from_env(kvfleet_env(serve_config())))
