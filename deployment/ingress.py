"""The Ray Serve application: an ingress deployment (HTTP) in front of the engine's deployment.

As Ray Serve LLM splits `OpenAiIngress` from `LLMServer`:
- `KVFleetEngine`, one replica per engine: owns the `Engine` (its rank actors and the stats aggregator), and
  answers `generate` (a stream of token events), `info` and `health` through its handle. Serve's
  `check_health` replaces the replica when its engine can no longer serve at all.
- `KVFleetIngress`, `ingress_replicas` replicas: the FastAPI routes. Generation goes to the engine's replica
  through a `DeploymentHandle` (streamed); tokenizing and detokenizing happen here. Statistics are served
  from the replica's `FleetStats` (one `StatsMirror`, one long-poll, per engine's aggregator), so readers
  never touch the engines' event loops.
Neither reserves CPU: the rank actors reserve theirs (dp * tp * num_cpus_per_rank), and the defaults must fit
a 2-core laptop, where `serve run deployment:app` gives Ray exactly 2 CPUs.
"""

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from deployment.fleet import FleetStats
from deployment.fleet_routing import FleetFollower, Routed, fleet_view
from deployment.resend import resending
from deployment.routes import create_api
from deployment.settings import Settings
from engine.errors import RETRY_AFTER_DOWN_S, EngineError, RequestError, RequestFailed, check_request

logger = logging.getLogger("kvfleet.deployment")

NUM_CPUS = 0
# /stats pollers, /stats/stream subscribers and streamed generations are long-lived: Serve's default (5)
# would queue them
MAX_ONGOING_REQUESTS = 1000
_ENGINE_ERRORS = (RequestError, EngineError, RequestFailed)
# fleet routers (one per ingress replica process) whose tickets an engine replica reports: the least recently
# updated go first
MAX_ROUTERS = 64
ENGINE_HEALTH_CHECK_S = 1.0  # Serve's health check period of the engine replicas (see KVFleetEngine)


class ActorStats:
    """The mirror's upstream: the StatsAggregator actor handle, given (the engine named it), or found by the
    engine's id: then looked up on first use and again after a failed call, since an engine that has not
    started yet has no aggregator, and one replaced by a new actor of the same name has a new handle."""

    def __init__(self, handle: Any = None, engine_id: str | None = None) -> None:
        if handle is None and engine_id is None:
            raise ValueError("ActorStats needs the aggregator's handle or its engine's id")
        self._h, self._engine_id = handle, engine_id

    def _handle(self) -> Any:
        if self._h is None:
            import ray

            from aggregator.actor import NAMESPACE, aggregator_name

            self._h = ray.get_actor(aggregator_name(self._engine_id), namespace=NAMESPACE)
        return self._h

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await getattr(self._handle(), method).remote(*args, **kwargs)
        except Exception:
            if self._engine_id is not None:
                self._h = None  # look it up again next time
            raise

    async def query(self, since: int, limit: int | None, ranks: bool) -> list[dict]:
        return await self._call("query", since=since, limit=limit, ranks=ranks)

    async def wait_records(self, since: int, timeout_s: float) -> list[dict]:
        return await self._call("wait_records", since, timeout_s=timeout_s)

    async def ranks(self) -> dict:
        return await self._call("ranks")

    async def kv_cache_stats(self) -> dict:
        return await self._call("kv_cache_stats")

    async def metrics_text(self) -> str:
        return await self._call("metrics_text")

    async def health(self) -> dict:
        return await self._call("health")


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    ray_actor_options={"num_cpus": NUM_CPUS},
    max_constructor_retry_count=3,
    graceful_shutdown_timeout_s=30,
    # how soon Serve's controller finds a dead replica (its default, 10 s, was most of a replica's recovery once
    # the replacement took its ranks over): a check is one call that reads a field
    health_check_period_s=ENGINE_HEALTH_CHECK_S,
)
class KVFleetEngine:
    async def __init__(self, settings: Settings) -> None:
        from engine.core import Engine  # imported here: importing `deployment` must stay light

        self._settings = settings
        self._tickets: dict[str, int] = {}  # the fleet router's newest ticket admitted, per router (follow)
        rank = serve.get_replica_context().rank.rank  # Serve's replica rank: the engine this replica is
        self._engine = Engine(settings.engine_config(rank))
        try:
            await self._engine.start()
        except BaseException:
            logger.exception("engine %s failed to start", self._engine.config.engine_id)
            await self._engine.shutdown()
            raise
        logger.info("engine %s started: dp=%d tp=%d model=%s", self._engine.config.engine_id, settings.dp, settings.tp,
                    settings.model or "built-in")

    def info(self) -> dict[str, Any]:
        e = self._engine
        return {"max_model_len": e.max_model_len, "max_seq_len": e.max_seq_len, "vocab_size": e.vocab_size,
                "aggregator": e.aggregator}

    async def generate(self, request_id: str | None, prompt_token_ids: list[int], params: Any,
                       cache_salt: str | None = None, drawn: int = 0, routed: Any = None) -> AsyncIterator[Any]:
        """None once the engine has admitted the request (so the ingress answers a refusal with its status
        code, before any response starts), then its token events. `drawn`: the request is re-sent (Engine.submit).
        `routed`: what the deployment's request router read and decided (`Routed`): the dp group the fleet's
        `kv` router chose for this engine, if it did."""
        placed = routed.placed(self._engine.config.engine_id) if isinstance(routed, Routed) else None
        events = self._engine.generate(request_id, prompt_token_ids, params, cache_salt, announce=True,
                                       drawn=drawn, placed=placed)
        if placed is not None:  # from the next report on, the router finds it in this engine's load and room
            # popped and put back: the dict's order is the routers' last update, the first one the stalest
            self._tickets[routed.router] = max(routed.ticket, self._tickets.pop(routed.router, -1))
            if len(self._tickets) > MAX_ROUTERS:  # the longest silent: an ingress replica long gone, likely
                self._tickets.pop(next(iter(self._tickets)))
        async with contextlib.aclosing(events):  # closed when this stream is: the engine aborts the request then
            async for ev in events:
                yield ev

    async def health(self) -> dict[str, Any]:
        return await self._engine.health()

    async def kv_events(self, after: str | None, timeout_s: float,
                        replica: str | None = None) -> list[tuple[str, dict]]:
        """Long poll of the KV event stream (engine/kv_stream.py): (id, vLLM-shaped event) after `after`.
        `replica`: the replica the `kv` router sends the call to (/kv_events?engine= with several)."""
        if replica is not None and replica != serve.get_replica_context().replica_id.unique_id:
            raise EngineError(f"engine {self._engine.config.engine_id!r} answered for replica {replica}, which "
                              "is not up: retry")
        return await self._engine.kv_events(after, timeout_s)

    async def follow(self, after: str | None, timeout_s: float, replica: str | None = None) -> dict[str, Any]:
        """The fleet's `kv` router's long poll (deployment/fleet_routing.py): this engine's KV events after
        `after`, then its groups' load and room. `replica`: the replica the router sends the call to."""
        e = self._engine
        me = serve.get_replica_context().replica_id.unique_id
        if replica is not None and replica != me:  # routed here while that replica is not in the router's set
            return {"replica": me}
        events = await e.kv_events(after, timeout_s)
        tickets = dict(self._tickets)  # a copy: Serve may pickle the answer on another thread while generate runs
        return {"replica": me, "engine": e.config.engine_id, "block_size": e.config.cache.tokens_per_block,
                "events": events, "groups": e.groups_state(), "tickets": tickets}

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats of this replica: its engine id (what a router, or an operator, can read)."""
        return {"engine": self._engine.config.engine_id}

    async def check_health(self) -> None:
        """Serve's replica health check: a replica whose engine cannot serve at all is replaced."""
        if self._engine.error:
            raise RuntimeError(self._engine.error)

    async def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            logger.info("engine %s shutting down", engine.config.engine_id)
            await engine.shutdown()


class EngineClient:
    """The engine as the routes see it, across the engine deployment's handle: the same errors as the
    in-process Engine (never a Ray traceback), and a stream that aborts the request when it is closed."""

    def __init__(self, handle: DeploymentHandle, tokenizer: Any, info: dict[str, Any], resend_s: float,
                 routing: str = "pow2", engines: list[str] | None = None) -> None:
        self._h = handle
        self.engines = engines or []  # the fleet's engine ids (several: /kv_events needs one named)
        self.routing = routing  # what the request router reads: the text (prefix_affinity), the tokens (kv)
        self.follower: FleetFollower | None = None
        if routing == "kv":  # the kv router's view of every replica's cache: followed from here
            self.follower = FleetFollower(handle, fleet_view(handle.app_name, handle.deployment_name))
            self.follower.start()
        self.resend_s = resend_s  # how long a request that lost its replica waits for one to take it again
        self._stream = handle.options(stream=True)
        self.tokenizer = tokenizer
        self.max_model_len = info["max_model_len"]
        self.max_seq_len = info["max_seq_len"]
        self.vocab_size = info["vocab_size"]

    async def validate(self, prompt_token_ids: list[int], params: Any) -> None:
        """The engine's own rules with the limits it advertised, here: no round trip before the stream (the
        engine applies them again when the request arrives)."""
        check_request(prompt_token_ids, params.max_tokens, self.vocab_size, self.max_model_len, self.max_seq_len)

    async def generate(self, request_id: str | None, prompt_token_ids: list[int], params: Any,
                       cache_salt: str | None = None) -> AsyncIterator[Any]:
        """None once the engine admitted the request, then its token events. A request waits for a replica to
        admit it up to `placement_timeout_s`, whether it is new (no replica is up: Serve queues the call while
        one starts) or re-sent after its replica died or could not be reached mid-stream (prompt + tokens so
        far, deployment/resend.py); then it is a 503."""

        text = self.tokenizer.decode(prompt_token_ids) if self.routing == "prefix_affinity" else None

        def send(rid: str | None, prompt: list[int], left: Any, drawn: int) -> Any:
            if self.routing == "kv":  # a re-send is routed anew, by what it is now: prompt + tokens so far
                routed = Routed(token_ids=prompt, cache_salt=cache_salt, max_tokens=left.max_tokens)
            else:
                routed = Routed(text) if text is not None else None
            return self._stream.generate.remote(rid, prompt, left, cache_salt, drawn, routed)

        events = resending(send, request_id, prompt_token_ids, params, self.resend_s, self.resend_s)
        try:
            async for ev in events:
                yield ev
        except Exception as e:
            raise _engine_error(e) from None
        finally:
            await events.aclose()  # a client that left (or a stop string) aborts the engine's request

    async def health(self) -> dict[str, Any]:
        try:
            return await self._h.health.remote()
        except Exception as e:
            raise _engine_error(e) from None

    async def kv_events(self, after: str | None, timeout_s: float,
                        engine: str | None = None) -> list[tuple[str, dict]]:
        """One engine's stream: with several, the one named, reached through the `kv` router's view of which
        replica is which engine (no other router can address a replica)."""
        replica = None
        if len(self.engines) > 1:
            if engine not in self.engines:
                raise RequestError(f"this app runs {len(self.engines)} engines: name one with ?engine= (one of "
                                   f"{', '.join(self.engines)})", "engine_required")
            if self.follower is None:
                raise RequestError("/kv_events of one of several engines needs fleet_routing=kv (Serve's other "
                                   "routers cannot address an engine replica)", "unsupported")
            replica = self.follower.replica_of(engine)
            if replica is None:
                raise EngineError(f"engine {engine!r} has no replica up now", 2.0)
        try:
            if replica is None:
                return await self._h.kv_events.remote(after, timeout_s)
            return await self._h.kv_events.remote(after, timeout_s, replica=replica)
        except Exception as e:
            raise _engine_error(e) from None


def _engine_error(e: Exception) -> Exception:
    """The engine's own error inside a Ray error, or EngineError when its replica cannot be reached."""
    cause = getattr(e, "cause", None)
    if isinstance(e, _ENGINE_ERRORS):
        return e.cause if isinstance(cause, _ENGINE_ERRORS) else e
    if isinstance(cause, _ENGINE_ERRORS):
        return cause
    return EngineError(f"the engine replica is unavailable ({type(e).__name__})", RETRY_AFTER_DOWN_S)


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    ray_actor_options={"num_cpus": NUM_CPUS},
    graceful_shutdown_timeout_s=30,
)
@serve.ingress()
class KVFleetIngress:
    async def __init__(self, settings: Settings, engine: DeploymentHandle) -> None:
        from workers.models import load_tokenizer

        self._settings = settings
        info = await engine.info.remote()  # waits for the engine's replica to be up
        self._engine = EngineClient(engine, load_tokenizer(settings.model or None), info,
                                    settings.placement_timeout_s, settings.fleet_policy, settings.engine_ids())
        self._stats = fleet_stats(settings, info["aggregator"])

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_api(self._engine, self._stats, self._settings)

    async def check_health(self) -> None:
        """Serve's replica health check: a replica whose stats mirror died is replaced."""
        self._stats.check()

    async def __del__(self) -> None:
        stats = getattr(self, "_stats", None)
        if stats is not None:
            await stats.close()
        engine = getattr(self, "_engine", None)
        if engine is not None and engine.follower is not None:
            await engine.follower.close()


def fleet_stats(settings: Settings, aggregator: Any) -> FleetStats:
    """One mirror per engine: with one, over the aggregator the engine named (as always); with several, each
    over its engine's aggregator by name (the replica that answered `info` is any one of them)."""
    ids = settings.engine_ids()
    if len(ids) == 1:
        upstreams = {ids[0]: ActorStats(aggregator)}
    else:
        upstreams = {eid: ActorStats(engine_id=eid) for eid in ids}
    return FleetStats.over(upstreams, capacity=settings.stats_buffer_size)


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
    from workers.models import check_model  # no torch; reads the file's header

    try:
        check_model(settings.model or None, settings.tp)
    except ValueError as exc:
        raise ValueError(f"invalid kvfleet settings: {exc}") from None


# the routers `fleet_routing` names: Serve's default, and Ray Serve LLM's prefix tree over what it routed (it
# scans the handle call's positional arguments for the first with a `prompt` or `messages` attribute, and reads
# the text there: here the `Routed` that EngineClient.generate passes last; none raises). The latter by its own
# module: its public re-export, ray.serve.llm.request_router, imports Ray Serve LLM's protocol models, which
# need vLLM or SGLang installed
FLEET_ROUTERS = {"kv": "deployment.kv_router:KVFleetRouter",
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
            "load_weight": settings.routing_load_weight, "free_weight": settings.routing_free_weight})
    return RequestRouterConfig(request_router_class=FLEET_ROUTERS[settings.fleet_policy])


def build_app(args: dict[str, Any] | None = None) -> Application:
    """`serve run deployment:build_app tp=2 ...` and Serve configs' `args:` land here."""
    settings = parse_settings(args)
    check_model_setting(settings)
    router = request_router(settings)
    engine = KVFleetEngine.options(num_replicas=settings.engine_replicas,
                                   ray_actor_options=actor_options(settings.engine_resource),
                                   **({"request_router_config": router} if router else {})).bind(settings)
    return KVFleetIngress.options(num_replicas=settings.ingress_replicas,
                                  ray_actor_options=actor_options(settings.ingress_resource)).bind(settings, engine)


def actor_options(resource: str) -> dict[str, Any]:
    """A replica's actor options: no CPU, and a sliver of `resource` when one is set, so Serve places (and
    replaces) it only on the nodes that advertise it (on KubeRay a worker group's, never the head's:
    k8s/README.md, "Across several nodes"). Serve's own placement knobs do not fit: `placement_group_strategy`
    is per replica, and node affinity would name a node id that a new node no longer has."""
    from aggregator.actor import SLIVER

    return {"num_cpus": NUM_CPUS, **({"resources": {resource: SLIVER}} if resource else {})}
