"""A request whose engine replica died is re-sent by the ingress, as a dead dp group's is inside an engine.

The ingress remembers the tokens each request has received. When the replica's stream breaks because the
replica died or cannot be reached, the request goes again over the handle (to whichever replica Serve routes it
to: the other replicas, or the one Serve starts in place of the only one) as prompt + tokens so far, with
max_tokens less what was received and the sampler's draw count, so a seeded sampler draws what the dead replica
would have (workers/sampling.py seeds per draw) and greedy decoding continues as it would have. The caller sees
one stream: `ADMITTED` once admitted, then every token exactly once, so the detokenizer and the stop strings never
see a gap or a repeat.

Why Serve's handle does not do this already: its router retries a request only while routing it (a replica
that rejects it, or that is found dead or unavailable before it accepted: serve/_private/router.py,
`route_and_send_request`, Ray 2.60), and Ray actor calls are at-most-once by default (`max_task_retries=0`,
Ray's actor fault tolerance docs). Once a replica has accepted a call, its death reaches the caller as the
call's error: the stream raises ActorDiedError (what tests/e2e/test_reliability_e2e.py sees when it kills the
replica's actor) or ActorUnavailableError (Serve's gRPC transport maps a broken channel to it). Serve's docs
say nothing of retrying a started (streaming) request, and it could not resume one anyway: only the ingress
knows which tokens the client already has.

What is not re-sent: anything a live engine raised (RequestError 400, Overloaded 429, EngineError 503,
RequestFailed 500), which reaches the ingress as a RayTaskError, not as the replica's death; but EngineStopping
is: the replica is going away (a scale-down) with the request admitted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from engine.backoff import backoff_s
from engine.errors import RETRY_AFTER_DOWN_S, EngineError, EngineStopping
from engine.messages import ADMITTED

logger = logging.getLogger("kvfleet.deployment")

# the pause between re-sends (doubling): Serve itself waits for a replica to route to, so this only paces a
# replica that keeps failing as soon as it is called (say, one that is unreachable)
RESEND_BACKOFF_S = (0.05, 1.0)

# send(request_id, prompt + tokens so far, params with what is left of max_tokens, draws done): the handle's
# stream (an async iterator with `cancel()`) of ADMITTED once admitted, then token events
Send = Callable[[str | None, list[int], Any, int], AsyncIterator[Any]]


def replica_lost(exc: BaseException) -> bool:
    """The replica died, cannot be reached, or is stopping (EngineStopping: Serve scaled it down while the
    request ran). A live engine's own error arrives as a RayTaskError, which is also an instance of its cause's
    class (a RayActorError the engine raised is then not the replica's)."""
    return isinstance(exc, EngineStopping) or (isinstance(exc, RayActorError) and not isinstance(exc, RayTaskError))


def with_seed(params: Any) -> Any:
    """A sampled request without a seed gets one here, before its first send. The engine would draw one at
    submit, but inside the replica that may die with it; picked here, every re-send carries the same seed and
    continues the very sequence the client has started receiving (no protocol change for the engine to tell)."""
    if params.seed is None and not params.greedy:
        return dataclasses.replace(params, seed=secrets.randbits(63))  # as Engine.submit draws it
    return params


async def resending(send: Send, request_id: str | None, prompt: list[int], params: Any, admission_s: float,
                    resend_s: float, lost: Callable[[BaseException], bool] = replica_lost) -> AsyncIterator[Any]:
    """`ADMITTED` once a replica admitted the request, then its token events, re-sent while replicas die. The first
    admission has `admission_s` (the ingress gives it `placement_timeout_s`, as a re-send: one rule for a
    request waiting for a replica); a request whose replica was lost after admitting it has `resend_s` from the
    loss to be admitted again, else EngineError (a 503)."""
    params = with_seed(params)
    got: list[int] = []
    deadline = time.monotonic() + admission_s
    tries = 0  # re-sends since the last loss
    announced = False
    for attempt in itertools.count():
        rid = request_id if attempt == 0 or request_id is None else f"{request_id}-resend{attempt}"
        left = dataclasses.replace(params, max_tokens=params.max_tokens - len(got))
        stream = send(rid, prompt + got, left, len(got))
        taken = False
        try:
            await _admission(stream, deadline, _too_late(announced, admission_s, resend_s))
            taken = True
            if not announced:
                announced = True
                yield ADMITTED
            async for ev in stream:
                got.append(ev.token_id)
                yield ev
                if ev.finish_reason is not None:
                    return
            return
        except Exception as exc:
            if not lost(exc):
                raise
            if taken:  # a new outage: the re-send has its own time, and starts with a short pause
                deadline, tries = time.monotonic() + resend_s, 0
            tries += 1
            logger.warning("request %s lost its engine replica (%s) after %d tokens: re-sending", request_id,
                           type(exc).__name__, len(got))
            await asyncio.sleep(max(0.0, min(backoff_s(tries, *RESEND_BACKOFF_S), deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                raise _too_late(announced, admission_s, resend_s) from None
        finally:
            stream.cancel()  # a client that left (or a stop string) aborts the engine's request


async def _admission(stream: Any, deadline: float, too_late: EngineError) -> None:
    """Until a replica admitted the request (its stream's first event, `ADMITTED`), at most until `deadline`."""
    try:
        await asyncio.wait_for(anext(stream), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise too_late from None


def _too_late(announced: bool, admission_s: float, resend_s: float) -> EngineError:
    if not announced:
        return EngineError(f"the engine replica did not answer within {admission_s:g} s (it may be restarting)",
                           admission_s)
    return EngineError(f"the engine replica was lost, and no replica took the request again within {resend_s:g} s",
                       RETRY_AFTER_DOWN_S)
