"""The RayService's Serve config, deployed as KubeRay would run it, on two Ray nodes of this machine.

The head and the worker are started with `ray start --block` from the manifest's rayStartParams (head
`num-cpus: "0"` included), the way KubeRay starts the head and worker pods; then `serve deploy` sends the
manifest's serveConfigV2, with its GPU settings swapped for CPU ones. As on Kubernetes, Ray's token auth is on
when the manifest's authOptions say so (every node, the CLI and the dashboard calls carry one token), and the
API keys reach the app through the nodes' environment, as the containers get them from the Secret. The test
checks that every rank and both Serve replicas run on the worker node (the head has no CPUs to give them),
that the dashboard refuses a caller without the token, and that a completion succeeds.

Isolation: this cluster must not touch the session `ray_cluster` fixture's cluster or another developer's,
so `ray stop` (which kills every Ray process of the user) is never used. Each node gets its own --temp-dir (so
its `ray_current_cluster` file, which bare `ray.init()` calls read, stays out of /tmp/ray) and free ports,
runs in its own session, and is stopped by SIGTERM to its `ray start --block` process (which kills the
node's processes), then SIGKILL to its process group, then SIGKILL to any process whose command line names
this test's temp dir.
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# The manifest's GPU settings, replaced for a CPU-only machine; everything else is deployed as written.
CPU_OVERRIDES = {
    "KVFLEET_DEVICE": "cpu",
    "KVFLEET_DTYPE": "float32",
    "KVFLEET_KV_CACHE_BYTES": "0",  # the CPU default: room for 1024 tokens of the model
    "KVFLEET_HOST_CACHE_BYTES": "-1",  # room for 2048 tokens
    "KVFLEET_NUM_CPUS_PER_RANK": "1",
    "KVFLEET_MAX_SEQ_LEN": "512",
}
WORKER_CPUS = 4  # the ingress (1 CPU) + dp*tp ranks x 1 CPU, with room to spare


def rayservice() -> dict[str, Any]:
    with (REPO / "k8s" / "rayservice.yaml").open() as f:
        return yaml.safe_load(f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 1.0) -> Any:
    """Poll `check` until it returns something truthy; fail with the last error after the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
            last = result
        except Exception as exc:  # noqa: BLE001 - reported on timeout
            last = repr(exc)
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}; last: {last}")


def ray_start_args(params: dict[str, str], overrides: dict[str, str]) -> list[str]:
    """`ray start` flags from rayStartParams, as KubeRay writes them (`--key=value`)."""
    merged = {**params, **overrides}
    return [f"--{k}={v}" for k, v in merged.items()]


def group_resources(group: dict) -> dict[str, float]:
    """The custom resources a group's rayStartParams advertise (KubeRay passes the quoted JSON to --resources)."""
    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)) if raw else {}


def node_ports() -> dict[str, str]:
    """Every port a Ray node opens, chosen free, so two nodes (and other clusters) share this host."""
    names = ("node-manager-port", "object-manager-port", "metrics-export-port", "runtime-env-agent-port",
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port")
    return {n: str(free_port()) for n in names}


def auth_mode() -> str:
    return rayservice()["spec"]["rayClusterConfig"].get("authOptions", {}).get("mode", "disabled")


def api_keys_supported() -> bool:
    from deployment.settings import Settings

    return {"api_keys", "metrics_api_key"} <= Settings.model_fields.keys()


def ray_cli_env(token: str | None) -> dict[str, str]:
    """Env for this cluster's `ray`/`serve` commands: the auth mode set explicitly on every one (KubeRay sets
    RAY_AUTH_MODE and RAY_AUTH_TOKEN in every container), never left to ~/.ray/auth_token, which `ray start
    --head` would read and `ray start --address` would not; and RAY_ADDRESS must not point them at another
    cluster."""
    env = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token" if token else "disabled")
    if token:
        env["RAY_AUTH_TOKEN"] = token
    return env


def ray_list(kind: str, dashboard: str, env: dict[str, str], *filters: str) -> list[dict[str, Any]]:
    """`ray list <kind>` in a subprocess: Ray's state API caches its auth token per process, and this test's
    process must stay free to talk to the session's (unauthenticated) cluster."""
    args = [str(VENV_BIN / "ray"), "list", kind, "--address", dashboard, "--format", "json", "--limit", "1000"]
    for f in filters:
        args += ["--filter", f]
    out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def procs_naming(needle: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


class LocalRayNode:
    """One `ray start --block` in its own session; stop() ends it and everything it spawned."""

    def __init__(self, name: str, args: list[str], temp_root: str, log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.temp_dir = os.path.join(temp_root, name)
        self.log = log_dir / f"ray-start-{name}.log"
        env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [str(VENV_BIN / "ray"), "start", "--block", f"--temp-dir={self.temp_dir}",
                 "--node-ip-address=127.0.0.1", *args],
                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def check_running(self) -> None:
        if self.proc.poll() is not None:
            pytest.fail(f"ray start ({self.name}) exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


@pytest.fixture
def two_node_cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    pytest.importorskip("engine.core", reason="engine/core.py (the Engine) is not written yet")
    spec = rayservice()["spec"]["rayClusterConfig"]
    (worker_group,) = spec["workerGroupSpecs"]
    # Short and unique: Ray puts unix sockets under it, and the final sweep kills by this path.
    temp_root = tempfile.mkdtemp(prefix="kvf-k8s-", dir="/tmp")
    gcs_port, dashboard_port = free_port(), free_port()
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    token = secrets.token_hex(32) if auth_mode() == "token" else None
    cli_env = ray_cli_env(token)
    # The containers read both keys from the kvfleet-api-keys Secret; here they are the nodes' environment.
    keys = {"KVFLEET_API_KEYS": secrets.token_hex(16), "KVFLEET_METRICS_API_KEY": secrets.token_hex(16)}
    node_env = {**cli_env, **(keys if api_keys_supported() else {})}
    nodes: list[LocalRayNode] = []
    try:
        head_args = ["--head", *ray_start_args(spec["headGroupSpec"]["rayStartParams"], {
            **node_ports(), "port": str(gcs_port), "dashboard-port": str(dashboard_port),
            "dashboard-host": "127.0.0.1", "include-dashboard": "true", "ray-client-server-port": str(free_port()),
            "object-store-memory": str(100 << 20), "resources": json.dumps({"head": 1}),
        })]
        nodes.append(LocalRayNode("head", head_args, temp_root, tmp_path, node_env))
        wait_for("the head's GCS", lambda: nodes[0].check_running() or _port_open(gcs_port), 60, 0.5)

        worker_args = ray_start_args(worker_group["rayStartParams"], {
            **node_ports(), "address": f"127.0.0.1:{gcs_port}", "num-cpus": str(WORKER_CPUS), "num-gpus": "0",
            "object-store-memory": str(100 << 20),
            # the group's own resources (kvfleet_control: the replicas and the aggregator go there), and a marker
            "resources": json.dumps({**group_resources(worker_group), "worker_node": 1}),
        })
        nodes.append(LocalRayNode("worker", worker_args, temp_root, tmp_path, node_env))

        def both_alive() -> list:
            for n in nodes:
                n.check_running()
            alive = [n for n in ray_list("nodes", dashboard, cli_env) if n["state"] == "ALIVE"]
            return alive if len(alive) == 2 else []

        alive = wait_for("both Ray nodes", both_alive, 120)
        (worker_node,) = [n for n in alive if "worker_node" in n["resources_total"]]
        (head_node,) = [n for n in alive if "head" in n["resources_total"]]
        assert "CPU" not in head_node["resources_total"], "the head must offer no CPUs (num-cpus: 0)"
        assert "GPU" not in head_node["resources_total"], "the head must offer no GPUs (num-gpus: 0)"
        yield {"dashboard": dashboard, "worker_node_id": worker_node["node_id"], "head_node_id": head_node["node_id"],
               "logs": tmp_path, "cli_env": cli_env, "token": token,
               "api_key": keys["KVFLEET_API_KEYS"] if api_keys_supported() else None}
    finally:
        for node in reversed(nodes):
            node.stop()
        for pid in procs_naming(temp_root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_root, ignore_errors=True)


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def served_model_name(env: dict[str, str]) -> str:
    from deployment.settings import Settings

    return Settings(**{k.removeprefix("KVFLEET_").lower(): v for k, v in env.items()}).served_model_name


def local_serve_config(http_port: int) -> dict[str, Any]:
    """The manifest's serveConfigV2 with CPU settings, and its proxy on the head only: two nodes on one host
    cannot both bind the Serve port (on Kubernetes each pod has its own network namespace)."""
    config = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    env = app["runtime_env"]["env_vars"]
    assert set(CPU_OVERRIDES) <= set(env), "override only settings the manifest sets"
    env.update(CPU_OVERRIDES)
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    return config


def test_serve_config_runs_ranks_on_the_worker_node(two_node_cluster, tmp_path):
    import httpx

    cluster = two_node_cluster
    http_port = free_port()
    config = local_serve_config(http_port)
    settings_env = config["applications"][0]["runtime_env"]["env_vars"]
    world_size = int(settings_env["KVFLEET_DP"]) * int(settings_env["KVFLEET_TP"])
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))

    deploy = subprocess.run(
        [str(VENV_BIN / "serve"), "deploy", str(config_path), "--address", cluster["dashboard"]],
        cwd=REPO, env=cluster["cli_env"], capture_output=True, text=True, timeout=120,
    )
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr

    serve_api = f"{cluster['dashboard']}/api/serve/applications/"
    dashboard_auth = {"Authorization": f"Bearer {cluster['token']}"} if cluster["token"] else {}
    if cluster["token"]:  # the Jobs/Serve API of the dashboard is closed to callers without the token
        assert httpx.get(serve_api, timeout=30).status_code in {401, 403}
    base = f"http://127.0.0.1:{http_port}"
    app_name = config["applications"][0]["name"]
    api_auth = {"Authorization": f"Bearer {cluster['api_key']}"} if cluster["api_key"] else {}
    with httpx.Client(base_url=base, timeout=30, headers=api_auth) as client:

        def healthy() -> bool:
            # The dashboard's Serve API says when a deploy failed, so a broken app fails fast.
            apps = httpx.get(serve_api, headers=dashboard_auth, timeout=30).json()["applications"]
            app = apps.get(app_name, {})
            if app.get("status") == "DEPLOY_FAILED":
                pytest.fail(f"serve deploy failed: {app.get('message', '')[-4000:]}")
            return app.get("status") == "RUNNING" and client.get("/health").status_code == 200

        wait_for("the Serve app to answer /health", healthy, 420, 3)

        completion = client.post("/v1/completions", json={
            "model": served_model_name(settings_env), "prompt": "KubeRay places ranks on", "max_tokens": 8,
        })
        assert completion.status_code == 200, completion.text
        body = completion.json()
        assert body["choices"][0]["finish_reason"] in {"stop", "length"}
        assert body["usage"]["completion_tokens"] >= 1
        if cluster["api_key"]:  # the keys from the nodes' environment reached the app, wherever Serve built it
            assert httpx.get(f"{base}/v1/models", timeout=30).status_code in {401, 403}

        # Every rank reported, and the cluster record covers them all. The manifest autoscales the engine
        # replicas, so the routes have the fleet's shape even with one engine: /stats/ranks is {engine: ranks}.
        def one_engines_ranks() -> dict:
            r = client.get("/stats/ranks").json()
            if r and not all(k.isdigit() for k in r):
                r = next(iter(r.values())) if len(r) == 1 else {}
            return r if len(r) == world_size else {}

        ranks = wait_for("/stats/ranks to list every rank", one_engines_ranks, 60)
        assert sorted(int(k) for k in ranks) == list(range(world_size))
        records = wait_for("a cluster record in /stats", lambda: client.get("/stats").json(), 60)
        assert records[-1]["numRanks"] == world_size

    # Placement: every rank actor and both Serve replicas live on the worker node.
    actors = ray_list("actors", cluster["dashboard"], cluster["cli_env"], "state=ALIVE")
    rank_nodes = [a["node_id"] for a in actors if a["class_name"] == "RankWorker"]
    assert len(rank_nodes) == world_size, [a["class_name"] for a in actors]
    assert set(rank_nodes) == {cluster["worker_node_id"]}
    replicas = [a for a in actors if a["class_name"].endswith(("KVFleetIngress", "KVFleetEngine"))]
    assert len(replicas) == 2 and {a["node_id"] for a in replicas} == {cluster["worker_node_id"]}
