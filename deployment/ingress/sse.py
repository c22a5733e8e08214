"""Server-Sent Events: the wire format written by /stats/stream and /kv_events and read by the client and the
benchmark.

Kept apart from the routes so the writer and the reader are tested against each other (the `id:` field
is what makes a reconnect with `Last-Event-ID` resume without a gap).
"""

from collections.abc import Mapping
from dataclasses import dataclass

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering or caching
# one Server-Sent Event as readers parse it (the OpenAPI document's schema of an event)
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                              "id": {"type": "string"}}}


def format_event(data: str, *, id: int | str | None = None, event: str | None = None) -> str:
    """One SSE event; multi-line data becomes several `data:` lines, as the spec requires."""
    lines = []
    if id is not None:
        lines.append(f"id: {id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return "\n".join(lines) + "\n\n"


def last_event_id(headers: Mapping[str, str]) -> str | None:
    """The `Last-Event-ID` a reconnecting client sent (None when absent or blank), for both streams; what it
    names is the stream's: an iteration on /stats/stream, `<incarnation>-<seq>` on /kv_events."""
    value = headers.get("last-event-id", "").strip()
    return value or None


def format_comment(text: str) -> str:
    """A comment line: ignored by readers, keeps proxies from closing an idle stream."""
    return f": {text}\n\n"


@dataclass
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEDecoder:
    """Incremental SSE parser (WHATWG rules): feed lines without their newline; a blank line ends an event."""

    def __init__(self) -> None:
        self.last_event_id: str | None = None
        self._data: list[str] = []
        self._event = ""
        self._retry: int | None = None

    def feed(self, line: str) -> SSEEvent | None:
        line = line.rstrip("\r")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self.last_event_id = value
        elif field == "retry" and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event, retry = self._data, self._event, self._retry
        self._data, self._event, self._retry = [], "", None
        if not data:
            return None
        return SSEEvent(data="\n".join(data), event=event or "message", id=self.last_event_id, retry=retry)
