"""Building the Serve application: settings parsed and the model checked once, then the engine deployment
(engine/serve.py) with its request router (router/) and the ingress deployment (ingress/) bound to it.
`serve run deployment:app` and `serve run deployment:build_app key=value ...` land here."""

import os
from typing import Any

from pydantic import ValidationError
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from deployment.ingress.serve import KVFleetIngress
from deployment.settings import Settings
from engine.serve import NUM_CPUS, KVFleetEngine


def parse_settings(args: dict[str, Any] | None) -> Settings:
    """Settings from builder args (`key=value` on the command line, or a Serve config's `args:`) + env."""
    given = {str(k).strip().lower().replace("-", "_"): v for k, v in (args or {}).items()}
    try:
        return Settings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        known = ", ".join(Settings.model_fields)
        raise ValueError(f"invalid kvfleet settings: {problems} (known settings: {known})") from None


def check_model_setting(settings: Settings) -> None:
    """The model file and tp, checked where the app is built: a bad one fails `serve run` (or a RayService's
    deploy) once, with one line naming the file, instead of failing every engine replica's constructor."""
    from workers.model_setting import check_model  # no torch; reads the file's header

    try:
        check_model(settings.model or None, settings.tp, settings.simulated_profile)
    except ValueError as exc:
        raise ValueError(f"invalid kvfleet settings: {exc}") from None


# the routers `fleet_routing` names: Serve's default, and Ray Serve LLM's prefix tree over what it routed (it
# scans the handle call's positional arguments for the first with a `prompt` or `messages` attribute, and reads
# the text there: here the `GenerateRequest` that EngineClient.generate passes, whose `prompt` it is; none
# raises). The latter by its own module: its public re-export, ray.serve.llm.request_router, imports Ray Serve
# LLM's protocol models, which need vLLM or SGLang installed
FLEET_ROUTERS = {"kv": "deployment.router.request_router:KVFleetRouter",
                 "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
                 "prefix_affinity": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
                                    "PrefixCacheAffinityRouter"}


def request_router(settings: Settings) -> RequestRouterConfig | None:
    """The engine deployment's request router: which engine replica takes a request (None: Serve's default,
    so `serve build` writes no router for it)."""
    if settings.fleet_policy == "pow2":
        return None
    if settings.fleet_policy == "kv":
        return RequestRouterConfig(request_router_class=FLEET_ROUTERS["kv"], request_router_kwargs={
            "primary_weight": settings.routing_primary_weight, "host_weight": settings.routing_host_weight,
            "load_weight": settings.load_weight, "free_weight": settings.routing_free_weight})
    return RequestRouterConfig(request_router_class=FLEET_ROUTERS[settings.fleet_policy])


def build_app(args: dict[str, Any] | None = None) -> Application:
    """`serve run deployment:build_app tp=2 ...` and Serve configs' `args:` land here."""
    for name, value in CONTROLLER_ENV.items():  # before `serve run`'s ray.init: its processes inherit it
        os.environ.setdefault(name, value)
    settings = parse_settings(args)
    check_model_setting(settings)
    router = request_router(settings)
    scaling = autoscaling_config(settings)
    replicas = {"autoscaling_config": scaling} if scaling else {"num_replicas": settings.engine_replicas}
    engine = KVFleetEngine.options(**replicas,
                                   ray_actor_options=actor_options(settings.engine_resource, push_env(settings)),
                                   **({"request_router_config": router} if router else {})).bind(settings)
    return KVFleetIngress.options(num_replicas=settings.ingress_replicas,
                                  ray_actor_options=actor_options(settings.ingress_resource,
                                                                  {**push_env(settings), **INGRESS_ENV})
                                  ).bind(settings, engine)


# Serve runs a handle's router on a thread and event loop of its own by default, and a replica's user code on
# another: in the ingress the kv router's decisions (1 ms of CPU at p99) then wait for the GIL that the loop
# streaming every token holds. On one loop the router, the follower (deployment/router/fleet_view.py) and the
# ingress share a thread and hand over only where they await (bench/README.md, fleet_scale.py: decision p99).
INGRESS_ENV = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


# Serve's controller runs its control loop every 0.1 s: with its GCS calls that was ~4% of a core in an idle
# deployment, ~440 context switches a second, and a rank that shares the machine's cores loses what they take.
# At 0.5 s an idle `serve run` deployment took 13% of a core, not 16%, and ~2,000 switches a second, not ~2,400
# (bench/README.md, "Thirteenth session"); replicas, health checks and autoscaling react within half a second.
# `serve run` builds the app before it starts Ray, so a cluster it starts inherits this; a cluster already up
# (a RayService, the tests' session cluster) keeps what it was started with. An operator's own value wins.
CONTROLLER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


# the autoscaling policies `autoscaling_policy` names (deployment/autoscale.py); `serve` is Serve's default
POLICIES = {"kv": "deployment.autoscale:KVAutoscalingPolicy",
            "threshold": "deployment.autoscale:ThresholdAutoscalingPolicy"}


def autoscaling_config(settings: Settings) -> AutoscalingConfig | None:
    """Serve's autoscaling of the engine replicas (None: `engine_replicas` fixed). A Serve config may still
    override it whole (its `deployments:` entry for KVFleetEngine), as any deployment option."""
    if not settings.autoscaling:
        return None
    policy = {}
    if settings.autoscaling_policy == "kv":
        policy = {"policy": AutoscalingPolicy(policy_function=POLICIES["kv"], policy_kwargs={
            "ttft_target_s": settings.autoscale_ttft_target_s})}
    elif settings.autoscaling_policy == "threshold":
        policy = {"policy": AutoscalingPolicy(policy_function=POLICIES["threshold"])}
    return AutoscalingConfig(min_replicas=settings.engine_replicas_min, max_replicas=settings.engine_replicas_max,
                             initial_replicas=settings.engine_replicas,
                             target_ongoing_requests=settings.autoscale_target_ongoing_requests,
                             upscale_delay_s=settings.autoscale_upscale_delay_s,
                             downscale_delay_s=settings.autoscale_downscale_delay_s,
                             look_back_period_s=settings.autoscale_look_back_s,
                             # Serve checks the look-back against it (deprecated for the push env below)
                             metrics_interval_s=settings.autoscale_metrics_interval_s, **policy)


def push_env(settings: Settings) -> dict[str, str]:
    """With autoscaling, how often the replicas (their load) and the ingress's handles (Serve's ongoing
    requests) report to Serve's controller: Serve reads these in each replica's process, 10 s by default, which
    would leave the policy a look-back window behind."""
    if not settings.autoscaling:
        return {}
    every = str(settings.autoscale_metrics_interval_s)
    return {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": every,
            "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": every}


def actor_options(resource: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A replica's actor options: no CPU, and a sliver of `resource` when one is set, so Serve places (and
    replaces) it only on the nodes that advertise it (on KubeRay a worker group's, never the head's:
    k8s/README.md, "Across several nodes"). Serve's own placement knobs do not fit: `placement_group_strategy`
    is per replica, and node affinity would name a node id that a new node no longer has."""
    from aggregator.actor import SLIVER

    return {"num_cpus": NUM_CPUS, **({"resources": {resource: SLIVER}} if resource else {}),
            **({"runtime_env": {"env_vars": env}} if env else {})}
