"""kvfleet's Ray Serve application.

`serve run deployment:app` starts it with settings from `KVFLEET_*` environment variables (defaults run
on a CPU-only machine); `serve run deployment:build_app key=value ...` takes settings as arguments.
Importing this package starts nothing (no Ray, no engine); `deployment.app` is built when first read.

Where each part runs: `build` (the application, built where `serve run` runs), `settings` (the `Settings`
class, the README table), `ingress/` (an ingress replica's process: its Serve class, the engine client with
re-send and resume, the Serve-free FastAPI app in `api/`, the stats view in `stats/`), `router/` (a deployment
handle's process: Serve's request router and the fleet view it decides with), `clients/` (tools the server never
runs: a Python client, a traffic generator). The engine's own Serve class is `engine/serve.py`.
"""

from typing import Any

from deployment.build import build_app
from deployment.ingress.serve import KVFleetIngress
from engine.serve import KVFleetEngine


def __getattr__(name: str) -> Any:
    """`deployment.app`, built (settings and model checked) when first read, as `serve run deployment:app`
    does: importing the package stays light, while a bad setting or model file fails the command at once."""
    if name == "app":
        globals()["app"] = build_app({})
        return globals()["app"]
    raise AttributeError(f"module 'deployment' has no attribute {name!r}")


__all__ = ["KVFleetEngine", "KVFleetIngress", "app", "build_app"]
