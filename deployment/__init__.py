"""kvfleet's Ray Serve application.

`serve run deployment:app` starts it with settings from `KVFLEET_*` environment variables (defaults run
on a CPU-only machine); `serve run deployment:build_app key=value ...` takes settings as arguments.
Importing this package binds the application but starts nothing (no Ray, no engine).

Modules: `settings` (the `Settings` class, the README table); `ingress` (the two Serve deployments:
`KVFleetEngine` owns the engine, `KVFleetIngress` serves HTTP through the engine's handle); `routes` (the app);
`generation` (the OpenAI routes over an `EngineProtocol`); `stats_routes` and `mirror` (statistics served from
each ingress replica's copy of the records); `protocol` (OpenAI request models and response shapes);
`errors` (OpenAI-shaped errors); `auth` (API keys); `dashboard_routes` (the /dashboard page);
`kv_events` (the /kv_events stream); `sse` and `detokenize` (stream formats, text with stop strings); `client`
and `loadgen` (a Python client of the statistics, and a traffic generator).
"""

from deployment.ingress import KVFleetEngine, KVFleetIngress, build_app

app = build_app({})

__all__ = ["KVFleetEngine", "KVFleetIngress", "app", "build_app"]
