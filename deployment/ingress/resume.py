"""Where a streamed completion stands, as its SSE event ids say, so a client whose stream was cut resumes it.

A streamed completion passes through the ingress replica that serves it (Serve's proxy relays its bytes), so
that replica's death cuts the stream whatever the engine does: the proxy cannot re-send a response it has
started, and nothing but the client knows which chunks arrived. A client that asks for it with
`stream_options: {"resumable": true}` (an extension, as vLLM's `continuous_usage_stats`; plain streams stay
plain, since line-based readers such as vLLM's and SGLang's serving benchmarks expect nothing but `data:`
lines) gets an `id:` on every chunk naming the response (its id and `created`), the seed it samples with, a
digest of the request, and the chunk's number. The client POSTs the same body again with
`Last-Event-ID: <the last id it read>`, to any ingress replica: the request runs again from its prompt with
that seed (greedy or seeded, the engine draws the same tokens), and only the chunks after that number are sent,
under the first response's id. Nothing is kept on the server: the id is the whole state, so the replica that
died held nothing the resume needs. The id also chains a hash of the chunks up to it: a resumed stream whose
chunks differ from what the client read ends with an in-band error (`stream_diverged`) instead of splicing
another answer onto it.

What it costs: the tokens already sent are generated again (the prompt's blocks are usually still cached).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

from deployment.ingress.api.errors import APIError

_ID = re.compile(r"^((?:chat)?cmpl-[0-9a-f]{32})\.(\d{1,12})\.(\d{0,19})\.([0-9a-f]{12})\.(\d{1,9})\.([0-9a-f]{8})$")


@dataclasses.dataclass(frozen=True)
class StreamPosition:
    """A streamed response: its id and `created`, the sampling seed (None: greedy), the request's digest, the
    number of the last chunk the client has (-1: none) and a hash of the chunks up to it."""

    rid: str
    created: int
    seed: int | None
    digest: str
    chunk: int = -1
    sent: str = ""

    def event_id(self, chunk: int, sent: str) -> str:
        seed = "" if self.seed is None else str(self.seed)
        return f"{self.rid}.{self.created}.{seed}.{self.digest}.{chunk}.{sent}"


def running_hash(before: str, chunk: str) -> str:
    """The hash of the chunks sent so far, chained: a resumed stream that made other chunks than the client read
    (an engine that did not draw the same tokens) is found out, not spliced onto what the client has."""
    return hashlib.blake2b(f"{before}{chunk}".encode(), digest_size=4).hexdigest()


def request_digest(kind: str, prompt_ids: list[int], params: Any, extra: tuple) -> str:
    """What must be the same for a resumed stream to be the same stream: the route, the prompt's tokens, the
    sampling parameters (the seed included) and what shapes the chunks (stop strings, usage)."""
    h = hashlib.blake2b(repr((kind, prompt_ids, params, extra)).encode(), digest_size=6)
    return h.hexdigest()


def parse(value: str, kind: str) -> StreamPosition:
    """The position a `Last-Event-ID` names; a 400 for anything that is not one of this route's ids."""
    m = _ID.match(value)
    prefix = "cmpl-" if kind == "text_completion" else "chatcmpl-"
    if m is None or not m.group(1).startswith(prefix) or (m.group(3) and int(m.group(3)) >= 2**63):
        raise APIError(400, f"Last-Event-ID {value[:80]!r} is not an event id of a streamed {kind}: send the "
                       "`id:` of the last event read, with the request's body unchanged",
                       code="invalid_last_event_id", param="Last-Event-ID")
    rid, created, seed, digest, chunk, sent = m.groups()
    return StreamPosition(rid, int(created), int(seed) if seed else None, digest, int(chunk), sent)


def resumed_params(pos: StreamPosition, params: Any) -> Any:
    """The request's sampling parameters with the seed of the stream it resumes; a body whose own seed is
    another one is another request (400)."""
    if pos.seed is None:
        return params
    if params.seed is not None and params.seed != pos.seed:
        raise APIError(400, f"Last-Event-ID names a stream sampled with seed {pos.seed}, this body asks for "
                       f"seed {params.seed}", code="invalid_last_event_id", param="Last-Event-ID")
    return dataclasses.replace(params, seed=pos.seed)
