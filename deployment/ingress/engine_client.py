"""The engine deployment as the ingress's routes see it (`EngineClient`): calls through its handle, with the
in-process Engine's errors, and a stream that re-sends a request whose replica died (resend.py)."""

from collections.abc import AsyncIterator
from typing import Any

from ray.serve.handle import DeploymentHandle

from deployment.ingress.resend import resending
from deployment.router.fleet_view import FleetFollower, fleet_view
from engine.errors import RETRY_AFTER_DOWN_S, EngineError, RequestError, RequestFailed, check_request
from engine.messages import EngineHealth, EngineInfo, GenerateRequest

_ENGINE_ERRORS = (RequestError, EngineError, RequestFailed)

# The token streams' handle options by `token_transport`. `grpc`: Serve's gRPC transport between deployments (the
# handle's `_by_reference=False`, which RAY_SERVE_THROUGHPUT_OPTIMIZED turns on for every handle) with plain
# pickle for our plain dataclasses. Every token is one streamed item, and this takes the ingress, engine and
# proxy 0.67x the CPU a token of Ray actor calls with cloudpickle (bench/http_bench.py `--token-path`): on a
# CPU node that is CPU the ranks get back. A replica's death still arrives as a RayActorError
# (ActorUnavailableError), an engine's own error as its RayTaskError, so resend.py works the same on both.
STREAM_OPTIONS: dict[str, dict[str, Any]] = {
    "grpc": {"_by_reference": False, "request_serialization": "pickle", "response_serialization": "pickle"},
    "actor_calls": {},
}


class EngineClient:
    """The engine as the routes see it, across the engine deployment's handle: the same errors as the
    in-process Engine (never a Ray traceback), and a stream that aborts the request when it is closed."""

    def __init__(self, handle: DeploymentHandle, tokenizer: Any, info: EngineInfo, resend_s: float,
                 routing: str = "pow2", engines: list[str] | None = None, transport: str = "grpc") -> None:
        self._h = handle
        # the fleet's engine ids (several: /kv_events needs one named); the fleet's own list under autoscaling
        self.engines = engines if engines is not None else []
        self.routing = routing  # what the request router reads: the text (prefix_affinity), the tokens (kv)
        self.follower: FleetFollower | None = None
        if routing == "kv":  # the kv router's view of every replica's cache: followed from here
            self.follower = FleetFollower(handle, fleet_view(handle.app_name, handle.deployment_name))
            self.follower.start()
        self.resend_s = resend_s  # how long a request that lost its replica waits for one to take it again
        self._stream = handle.options(stream=True, **STREAM_OPTIONS[transport])
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.max_seq_len = info.max_seq_len
        self.vocab_size = info.vocab_size

    async def validate(self, prompt_token_ids: list[int], params: Any) -> None:
        """The engine's own rules with the limits it advertised, here: no round trip before the stream (the
        engine applies them again when the request arrives)."""
        check_request(prompt_token_ids, params.max_tokens, self.vocab_size, self.max_model_len, self.max_seq_len)

    async def generate(self, request_id: str | None, prompt_token_ids: list[int], params: Any,
                       cache_salt: str | None = None) -> AsyncIterator[Any]:
        """`ADMITTED` once the engine admitted the request, then its token events. A request waits for a replica to
        admit it up to `placement_timeout_s`, whether it is new (no replica is up: Serve queues the call while
        one starts) or re-sent after its replica died or could not be reached mid-stream (prompt + tokens so
        far, deployment/ingress/resend.py); then it is a 503."""

        text = self.tokenizer.decode(prompt_token_ids) if self.routing == "prefix_affinity" else ""

        def send(rid: str | None, prompt: list[int], left: Any, num_output_tokens: int) -> Any:
            # a re-send is routed anew (`kv`), by what it is now: prompt + tokens so far
            return self._stream.generate.remote(GenerateRequest(prompt, left, rid, cache_salt, num_output_tokens, text))

        events = resending(send, request_id, prompt_token_ids, params, self.resend_s, self.resend_s)
        try:
            async for ev in events:
                yield ev
        except Exception as e:
            raise _engine_error(e) from None
        finally:
            await events.aclose()  # a client that left (or a stop string) aborts the engine's request

    async def health(self) -> EngineHealth:
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
