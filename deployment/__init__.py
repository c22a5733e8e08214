"""kvfleet's Ray Serve application.

`serve run deployment:app` starts it with settings from `KVFLEET_*` environment variables (defaults run
on a CPU-only machine); `serve run deployment:build_app key=value ...` takes settings as arguments.
Importing this package starts nothing (no Ray, no engine); `deployment.app` is built when first read.

Modules: `settings` (the `Settings` class, the README table); `ingress` (the two Serve deployments:
`KVFleetEngine` owns the engine, `KVFleetIngress` serves HTTP through the engine's handle); `resend` (a dead
engine replica's requests re-sent by the ingress); `resume` (a stream cut with its ingress replica, resumed by
the client with Last-Event-ID); `routes` (the app);
`generation` (the OpenAI routes over an `EngineProtocol`); `stats_routes` and `mirror` (statistics served from
each ingress replica's copy of the records); `protocol` (OpenAI request models and response shapes);
`errors` (OpenAI-shaped errors); `auth` (API keys); `dashboard_routes` (the /dashboard page);
`kv_events` (the /kv_events stream); `sse` and `detokenize` (stream formats, text with stop strings); `client`
and `loadgen` (a Python client of the statistics and of streamed completions, and a traffic generator).
"""

from typing import Any

from deployment.ingress import KVFleetEngine, KVFleetIngress, build_app


def __getattr__(name: str) -> Any:
    """`deployment.app`, built (settings and model checked) when first read, as `serve run deployment:app`
    does: importing the package stays light, while a bad setting or model file fails the command at once."""
    if name == "app":
        globals()["app"] = build_app({})
        return globals()["app"]
    raise AttributeError(f"module 'deployment' has no attribute {name!r}")


__all__ = ["KVFleetEngine", "KVFleetIngress", "app", "build_app"]
