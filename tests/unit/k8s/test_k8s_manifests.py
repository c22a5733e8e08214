"""The k8s/ manifests are checked the way a cluster would check them, without a cluster.

RayService/RayCluster against KubeRay's CRD schemas (with unknown fields rejected, as `kubectl apply
--validate=strict` does), core kinds and the Ray pod templates with kubernetes-validate, the kustomize
render, the embedded serveConfigV2 against Ray's ServeDeploySchema and against what `serve build` makes of
the app today, and the Grafana dashboard against the metric names the aggregator exports.
"""

import copy
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "k8s"
CRDS = REPO.parent / "shared" / "kuberay-crds"
DASHBOARD = K8S / "monitoring" / "grafana-dashboard.json"
K8S_VERSION = "1.33.0"  # a Kubernetes version kubernetes-validate ships schemas for
RAY_KINDS = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB of YAML


def load_docs(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [d for d in yaml.load_all(f, Loader=SAFE_LOADER) if d]


def manifest_docs() -> list[tuple[str, dict[str, Any]]]:
    """Every document of every k8s/**/*.yaml except kustomization.yaml, with its file name."""
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out += [(str(path.relative_to(REPO)), d) for d in load_docs(path)]
    return out


def docs_of_kind(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(name, d) for name, d in manifest_docs() if d.get("kind") == kind]


def rayservice() -> dict[str, Any]:
    (_, doc), = docs_of_kind("RayService")
    return doc


def serve_config() -> dict[str, Any]:
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


def cluster_specs() -> list[tuple[str, dict[str, Any]]]:
    """(name, RayCluster spec) for the RayCluster and the RayService's embedded cluster."""
    specs = [(name, d["spec"]) for name, d in docs_of_kind("RayCluster")]
    specs += [(name, d["spec"]["rayClusterConfig"]) for name, d in docs_of_kind("RayService")]
    return specs


def ray_containers(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(group name, Ray container) for the head and every worker group: KubeRay's container index 0."""
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    return [(name, g["template"]["spec"]["containers"][0]) for name, g in groups]


# --- CRD schemas -------------------------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected: the API server prunes them silently, strict field
    validation (`kubectl apply --validate=strict`) refuses them, and a typo must fail this test."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(kind: str):
    jsonschema = pytest.importorskip("jsonschema")
    if not CRDS.is_dir():
        pytest.skip(f"KubeRay CRDs not found at {CRDS} (shared data, not part of the repo)")
    return _crd_validator(kind, jsonschema.Draft7Validator)


@functools.cache
def _crd_validator(kind: str, validator_class: type):
    (crd,) = load_docs(CRDS / RAY_KINDS[kind])
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return validator_class(strict(version["schema"]["openAPIV3Schema"]))


def crd_errors(kind: str, doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator(kind).iter_errors(doc)]


def test_manifests_hold_one_rayservice_and_one_raycluster():
    assert len(docs_of_kind("RayService")) == 1
    assert len(docs_of_kind("RayCluster")) == 1


@pytest.mark.parametrize("kind", sorted(RAY_KINDS))
def test_ray_resources_validate_against_kuberay_crds(kind):
    docs = docs_of_kind(kind)
    assert docs, f"no {kind} in k8s/"
    for name, doc in docs:
        assert doc["apiVersion"] == "ray.io/v1", name
        assert crd_errors(kind, doc) == [], name


def test_crd_validation_rejects_typos_and_wrong_types():
    """The schema check bites: an unknown field, a non-string rayStartParams value and a missing
    required field each fail."""
    good = rayservice()
    assert crd_errors("RayService", good) == []

    typo = copy.deepcopy(good)
    typo["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {"num-cpus": "0"}
    assert any("rayStartParam" in e for e in crd_errors("RayService", typo))

    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert crd_errors("RayService", wrong_type)

    missing = copy.deepcopy(good)
    del missing["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in e for e in crd_errors("RayService", missing))

    bad_container = copy.deepcopy(good)
    head = bad_container["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["resources"]["limits"]["cpu"] = "two"
    assert crd_errors("RayService", bad_container)


# --- core kinds ------------------------------------------------------------------------------------------


def k8s_validate(doc: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def as_pod(name: str, template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**template.get("metadata", {}), "name": name},
            "spec": template["spec"]}


def test_ray_pod_templates_are_valid_core_pods():
    """Each group's pod template, as the Pod KubeRay will create from it, passes the core Pod schema."""
    templates = [g["template"] for _, spec in cluster_specs()
                 for g in [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]]
    assert len(templates) == 4
    for i, template in enumerate(templates):
        k8s_validate(as_pod(f"pod-{i}", template))


def test_core_kind_validation_bites():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    head = rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    bad = copy.deepcopy(head)
    bad["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalations"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(as_pod("bad", bad))


CORE_KINDS = {"Service", "PersistentVolumeClaim", "Deployment", "NetworkPolicy", "PodDisruptionBudget"}


def test_core_kinds_validate():
    """Redis, the NetworkPolicies and the PodDisruptionBudget pass their Kubernetes schemas (strict)."""
    docs = [d for _, d in manifest_docs() if d["kind"] in CORE_KINDS]
    assert {d["kind"] for d in docs} == CORE_KINDS
    for doc in docs:
        k8s_validate(doc)


# --- what the manifests must say -------------------------------------------------------------------------


def plain_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_head_runs_no_ranks_and_no_gpu_work_and_exposes_serve_and_dashboard():
    """The head offers Ray no CPUs and no GPUs, and sees no GPU device even on a GPU node whose container
    runtime would hand a CUDA image every GPU (NVIDIA_VISIBLE_DEVICES=void)."""
    for name, spec in cluster_specs():
        head = spec["headGroupSpec"]
        assert head["rayStartParams"]["num-cpus"] == "0", name
        assert head["rayStartParams"]["num-gpus"] == "0", name
        container = head["template"]["spec"]["containers"][0]
        assert gpu_count(container) == 0, name
        assert plain_env(container)["NVIDIA_VISIBLE_DEVICES"] == "void", name
        ports = {p["containerPort"] for p in container["ports"]}
        assert {6379, 8265, 8000} <= ports, name


def gpu_count(container: dict[str, Any]) -> int:
    resources = container["resources"]
    requests = int(resources.get("requests", {}).get("nvidia.com/gpu", 0))
    limits = int(resources.get("limits", {}).get("nvidia.com/gpu", 0))
    assert requests == limits, f"{container['name']}: GPU requests {requests} != limits {limits}"
    return limits


def test_gpu_workers_request_gpus_and_resources():
    for name, spec in cluster_specs():
        workers = spec["workerGroupSpecs"]
        assert workers, name
        for group in workers:
            container = group["template"]["spec"]["containers"][0]
            assert gpu_count(container) >= 1, (name, group["groupName"])
            res = container["resources"]
            for key in ("cpu", "memory"):
                assert res["requests"][key] == res["limits"][key], (name, key)
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name


# KubeRay 1.7 injects HTTP probes (GET /api/healthz on the dashboard agent port, which checks the raylet and,
# on the head, the GCS) for rayVersion >= 2.53, and only into a Ray container that has none of its own; a
# RayService worker's readiness probe also checks its Serve proxy (/-/healthz on the serve port).
KUBERAY_HTTP_PROBES_SINCE = (2, 53)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:2])


def test_ray_containers_leave_probes_to_kuberay():
    for name, spec in cluster_specs():
        assert version_tuple(spec["rayVersion"]) >= KUBERAY_HTTP_PROBES_SINCE, name
        for group, container in ray_containers(spec):
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert probe not in container, f"{name} {group}: a hand-written {probe} replaces KubeRay's"
        # KubeRay's readiness probe of a RayService worker looks for the Serve proxy on the port named serve.
        for group, container in ray_containers(spec)[1:]:
            assert {"name": "serve", "containerPort": 8000} in container["ports"], (name, group)



def test_every_ray_container_runs_with_the_ray_config_the_soak_measured():
    """tests/support/multinode_support.py's RAY_CONFIG (what the chaos soak's cluster runs with, and why) as RAY_<name>
    env on every Ray container: the GCS reads them from its own environment, the workers from theirs."""
    from tests.support.multinode_support import RAY_CONFIG

    want = {f"RAY_{key}": str(value) for key, value in RAY_CONFIG.items()}
    for name, spec in cluster_specs():
        for group, container in ray_containers(spec):
            env = plain_env(container)
            assert {key: env.get(key) for key in want} == want, (name, group)


def test_the_head_runs_its_gcs_with_the_allocator_settings_the_soak_measured():
    """tests/support/multinode_support.py's GCS_MALLOC_ENV on the head's Ray container, where the GCS runs: Ray hands
    RAY_JEMALLOC_CONF to the GCS as MALLOC_CONF only while RAY_JEMALLOC_PROFILE names it."""
    from tests.support.multinode_support import GCS_MALLOC_ENV

    for name, spec in cluster_specs():
        env = plain_env(ray_containers(spec)[0][1])
        assert {key: env.get(key) for key in GCS_MALLOC_ENV} == GCS_MALLOC_ENV, name


def test_one_image_and_ray_version_everywhere():
    import ray

    dockerfile = (K8S / "Dockerfile").read_text()
    (ray_version,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    assert ray_version == ray.__version__
    assert "FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu@${RAY_IMAGE_DIGEST}" in dockerfile
    (tag,) = set(re.findall(r"-t (\S+) \.$", dockerfile, re.M))
    for name, spec in cluster_specs():
        assert spec["rayVersion"] == ray_version, name
        for group, container in ray_containers(spec):
            assert container["image"] == tag, (name, group)


def test_upgrade_strategy():
    assert rayservice()["spec"]["upgradeStrategy"]["type"] in {"NewCluster", "NewClusterWithIncrementalUpgrade"}


# --- serveConfigV2 ---------------------------------------------------------------------------------------


def test_serve_config_parses_with_ray_schema():
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config())
    (app,) = schema.applications
    assert app.import_path == "deployment:app"
    assert schema.http_options.port == 8000 and schema.http_options.host == "0.0.0.0"


def kvfleet_env(config: dict[str, Any]) -> dict[str, str]:
    (app,) = config["applications"]
    return app["runtime_env"]["env_vars"]


def settings_from_env(env: dict[str, str]):
    """deployment.settings.Settings as the app builds them from these KVFLEET_* env vars."""
    from deployment.settings import Settings

    return Settings(**{k.removeprefix("KVFLEET_").lower(): v for k, v in env.items()})


# The engine deployment's options the code sets from the settings (deployment/build.py): replicas or
# autoscaling, and the fleet's request router. A Serve config's entry would override the code's and could drift
# from the KVFLEET_* env, so the manifest leaves them out; an autoscaling_config may be written to override the
# policy (k8s/README.md, "Autoscaling"), with the settings' bounds (test_k8s_autoscaling.py).
CODE_DECIDED = {"KVFleetEngine": {"num_replicas", "autoscaling_config", "request_router_config"}}
OVERRIDABLE = {"KVFleetEngine": {"autoscaling_config"}}


def test_serve_env_vars_are_valid_settings_sized_to_the_gpus():
    from deployment.settings import Settings

    env = kvfleet_env(serve_config())
    assert all(isinstance(v, str) for v in env.values()), "runtime_env env_vars must be strings"
    unknown = {k for k in env if k.removeprefix("KVFLEET_").lower() not in Settings.model_fields}
    assert not unknown, f"not kvfleet settings: {unknown}"
    settings = settings_from_env(env)
    assert settings.device == "cuda"
    gpus = sum(g["replicas"] * gpu_count(g["template"]["spec"]["containers"][0])
               for g in rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"])
    assert settings.engine_replicas * settings.dp * settings.tp == gpus, "one rank per GPU at deploy"
    # the engine ids, the fleet's router and the autoscaling bounds follow the KVFLEET_* settings, which the code
    # turns into the deployment's options: a config entry for them would override the code's
    (app,) = serve_config()["applications"]
    for d in app["deployments"]:
        name = d["name"]
        assert not (CODE_DECIDED.get(name, set()) - OVERRIDABLE.get(name, set())) & d.keys(), name
    worker = rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    worker_cpus = int(worker["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    deployments = serve_config()["applications"][0]["deployments"]
    assert {d["name"] for d in deployments} == {"KVFleetEngine", "KVFleetIngress"}
    cpus = [d["ray_actor_options"]["num_cpus"] for d in deployments]
    assert min(cpus) > 0, "a 0-CPU replica may land on the head, whose worker pods then run no Serve proxy"
    assert settings.dp * settings.tp * settings.num_cpus_per_rank + sum(cpus) <= worker_cpus


def control_resource(group: dict[str, Any]) -> float:
    """The kvfleet_control a group's `ray start` advertises (KubeRay passes the quoted JSON to --resources)."""
    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)).get("kvfleet_control", 0) if raw else 0


def test_the_replicas_and_the_aggregator_are_placed_on_the_group_that_advertises_their_resource():
    env = kvfleet_env(serve_config())
    assert env["KVFLEET_INGRESS_RESOURCE"] == env["KVFLEET_ENGINE_RESOURCE"] == "kvfleet_control"
    for d in serve_config()["applications"][0]["deployments"]:
        assert d["ray_actor_options"]["resources"] == {"kvfleet_control": 0.001}, d["name"]
    for name, spec in cluster_specs():
        assert control_resource(spec["headGroupSpec"]) == 0, name  # a head restart must not take them
        assert [control_resource(g) > 0 for g in spec["workerGroupSpecs"]] == [True], name


def test_raycluster_env_matches_the_rayservice_settings():
    """The interactive cluster runs the same engine: its containers' KVFLEET_* env is the RayService's."""
    (_, cluster), = docs_of_kind("RayCluster")
    for group, container in ray_containers(cluster["spec"]):
        env = {k: v for k, v in plain_env(container).items() if k.startswith("KVFLEET_")}
        assert env == kvfleet_env(serve_config()), group


def serve_build_config(tmp_path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """What `serve build deployment:app` writes today, with `env` (KVFLEET_* settings) in its environment
    instead of any of this shell's; skipped while the app does not exist yet."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}, **(env or {})}
    probe = subprocess.run(
        [sys.executable, "-c", "import deployment; deployment.app"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )
    if probe.returncode != 0:
        last = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "?"
        if last.startswith(("AttributeError", "ModuleNotFoundError: No module named 'deployment")):
            pytest.skip(f"deployment:app is not importable yet ({last})")
        pytest.fail(f"importing deployment:app failed:\n{probe.stderr[-3000:]}")
    out = tmp_path / "serve_build.yaml"
    serve = Path(sys.executable).with_name("serve")
    built = subprocess.run(
        [str(serve), "build", "deployment:app", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    return yaml.safe_load(out.read_text())


# The manifest's only deliberate departures from `serve build`: the engine's and the ingress replica reserve a
# CPU each and a sliver of kvfleet_control, so they run on a GPU worker that advertises it (the head offers
# neither) rather than anywhere a 0-CPU actor fits; and the options in CODE_DECIDED are left to the code.
CONTROL = {"num_cpus": 1, "resources": {"kvfleet_control": 0.001}}  # KVFLEET_*_RESOURCE asks the same
MANIFEST_DEPLOYMENT_OVERRIDES = {"KVFleetEngine": {"ray_actor_options": CONTROL},
                                 "KVFleetIngress": {"ray_actor_options": CONTROL}}


def with_overrides(app: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(app)
    for deployment in out.get("deployments", []):
        for key, value in MANIFEST_DEPLOYMENT_OVERRIDES.get(deployment["name"], {}).items():
            deployment[key] = {**deployment.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def app_entry(app: dict[str, Any]) -> dict[str, Any]:
    """The parts of an application entry that code decides (runtime_env and name are the manifest's), but
    for the options in CODE_DECIDED (the settings' own)."""
    deployments = sorted(({k: v for k, v in d.items() if k not in CODE_DECIDED.get(d["name"], set())}
                          for d in app.get("deployments", [])), key=lambda d: d["name"])
    return {"import_path": app["import_path"], "route_prefix": app.get("route_prefix", "/"),
            "args": app.get("args", {}), "deployments": deployments}


def test_serve_config_matches_serve_build(tmp_path):
    """No drift: the manifest's application is what `serve build` makes of the app with the manifest's
    settings (as the cluster builds it), plus the env vars it adds on purpose. A config's ray_actor_options
    replaces the code's whole, so what the code puts there (the autoscaling metric push env) must be there."""
    built = serve_build_config(tmp_path, kvfleet_env(serve_config()))
    ours = serve_config()
    (built_app,) = built["applications"]
    (our_app,) = ours["applications"]
    assert app_entry(our_app) == app_entry(with_overrides(built_app))
    assert ours.get("proxy_location", "EveryNode") == built.get("proxy_location", "EveryNode")
    assert set(our_app["runtime_env"]) == {"env_vars"}
    assert not (built_app.get("runtime_env") or {}).get("env_vars"), "serve build added env vars: merge them"
