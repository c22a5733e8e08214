"""kvfleet's Ray Serve application.

`serve run deployment:app` starts it with settings from `KVFLEET_*` environment variables (defaults run
on a CPU-only machine); `serve run deployment:build_app key=value ...` takes settings as arguments.
Importing this package binds the application but starts nothing (no Ray, no engine).
"""

from deployment.ingress import KVFleetEngine, KVFleetIngress, build_app

app = build_app({})

__all__ = ["KVFleetEngine", "KVFleetIngress", "app", "build_app"]
