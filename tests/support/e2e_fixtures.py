"""The one Serve app shared by every e2e test of the session (`serve_app`, which conftest.py makes every test's).

Started once on the session `ray_cluster` with small CPU reservations, on a free loopback port (other
people's clusters may hold Serve's default 8000), and deleted at the end of the session.
"""

import contextlib
import os
import pathlib
import socket
import subprocess
import time

import httpx
import pytest

E2E_APP_NAME = "kvfleet-e2e"
# the built-in random model and its small KV cache: the e2e tests check the serving machinery, not a model
E2E_SETTINGS = {"model": "random", "dp": "2", "num_cpus_per_rank": "0.5", "max_seq_len": "256",
                "max_tokens_default": "8"}
START_TIMEOUT_S = 300


def keep_serves_controller_loop() -> None:
    """A test cluster started after this runs Serve's own controller loop (0.1 s), as a RayService's head has it,
    not the 0.5 s build_app sets for a cluster `serve run` starts (deployment/build.py CONTROLLER_ENV), whichever
    test built an app first: the suite deploys many apps, and each deploy waits a few controller loops."""
    os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] = "0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=10)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)  # poll interval
    raise TimeoutError(f"{url}/health not healthy after {timeout_s}s: {last}")


def start_app(name: str, settings: dict, route_prefix: str = "/") -> str:
    """Run a kvfleet app on the session's Serve (started here if need be); its base URL once healthy."""
    from ray import serve

    from deployment import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        from ray.serve.context import _get_global_client

        port = _get_global_client().http_config.port  # Serve may already be running with its own port
    except Exception:
        pass
    serve.run(build_app(settings), name=name, route_prefix=route_prefix)
    url = f"http://127.0.0.1:{port}{route_prefix.rstrip('/')}"
    wait_healthy(url, START_TIMEOUT_S)
    return url


def module_app(name: str, settings: dict, route_prefix: str):
    """A module's own app on the session cluster: started once for the module's tests, deleted after them."""

    @pytest.fixture(scope="module")
    def app(ray_cluster):
        from ray import serve

        yield start_app(name, settings, route_prefix=route_prefix)
        if name in serve.status().applications:
            serve.delete(name)

    return app


@pytest.fixture(scope="session")
def serve_app(ray_cluster) -> str:
    """Base URL (http://127.0.0.1:PORT) of the running kvfleet app."""
    from ray import serve

    yield start_app(E2E_APP_NAME, E2E_SETTINGS)
    serve.delete(E2E_APP_NAME)


@contextlib.contextmanager
def prometheus_server(target: str, workdir: pathlib.Path):
    """A real Prometheus server (loopback, free port) scraping http://TARGET/metrics every second; yields its
    base URL. The server is always killed after."""
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: kvfleet\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    log_path = workdir / "prometheus.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=log,
        )
    try:
        proc.log_path = log_path
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def instant_query(base: str, proc, query: str) -> list[dict] | None:
    """The result of one instant PromQL query, or None while the server does not answer."""
    if proc.poll() is not None:
        raise RuntimeError(f"prometheus exited ({proc.returncode}): {proc.log_path.read_text()[-2000:]}")
    try:
        r = httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=5)
    except httpx.HTTPError:
        return None
    if r.status_code == 503:  # still starting
        return None
    if r.status_code != 200:
        raise AssertionError(f"PromQL {query!r} was refused: {r.text[:500]}")
    return r.json()["data"]["result"]


def prometheus_query(target: str, query: str, workdir: pathlib.Path, timeout_s: float = 60) -> list[dict]:
    """The first non-empty result of the PromQL `query` on a Prometheus server scraping TARGET."""
    with prometheus_server(target, workdir) as (base, proc):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = instant_query(base, proc, query)
            if result:
                return result
            time.sleep(1.0)  # poll interval (one scrape interval)
        raise TimeoutError(f"no PromQL answer for {query!r} in {timeout_s}s")


def engine_records(c, engine: str) -> list[dict]:
    """Every record of one engine of a fleet, page by page (`c`: a StatsClient)."""
    out, since = [], -1
    while page := c.get_stats(since=since, limit=1000, engine=engine):
        out.extend(page)
        since = page[-1]["iter"]
    return out


def summed_counters(records: list[dict], counters: dict[str, str]) -> dict[str, int]:
    """The records' iteration counters summed over every window (`counters`: iteration name -> cumulative
    name), to hold against the change of the cumulative kvCacheStats: the conservation law."""
    out = dict.fromkeys(counters.values(), 0)
    for r in records:
        for bucket in r["kvCacheIterationStats"].values():
            for it, cum in counters.items():
                out[cum] += bucket.get(it, 0)
    return out


def completion_text(url: str, body: dict, stream: bool, started=None, timeout: float = 120) -> str:
    """A completion's text, streamed or not (asserting 200 and no in-band error); `started` (a
    threading.Event) is set at the first streamed text chunk."""
    import json

    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    parts = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                parts.append(chunk["choices"][0]["text"])
                if started is not None:
                    started.set()
    return "".join(parts)
