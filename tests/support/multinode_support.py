"""A real multi-node Ray cluster on one machine, as Ray's own fault-tolerance tests and KubeRay's e2e tests run one
(`ray.cluster_utils.Cluster`: one raylet per node, each with its own resources and object store), and the
kvfleet app on it.

Shape, as on KubeRay: a head that reserves no CPU for ranks but advertises the control resource (the Serve
replicas and the aggregators run there: `ingress_resource` / `engine_resource`), and worker nodes whose CPUs
are the ranks'. A node is lost with `remove_node(allow_graceful=False)`: its raylet and every process on it are
killed at once, as a pod that disappears.

Its own cluster cannot share a process with the session's `ray_cluster` (ray.init once per process), so the
multi-node tests run in a pytest process of their own (`-m multinode`; see conftest.py and the Makefile).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.e2e_fixtures import free_port, keep_serves_controller_loop, wait_healthy

CONTROL = "kvfleet_control"  # what the head advertises for the Serve replicas and the aggregators
OBJECT_STORE = 80 * 1024 * 1024  # per node: the random model moves little through the object store
START_TIMEOUT_S = 240
FAST_NODE_VERDICT = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
# Ray's settings for a long-lived kvfleet cluster, as k8s/ sets them (RAY_<name> on every Ray container;
# tests/unit/k8s/test_k8s_manifests.py checks).
# Ray keeps up to 1000 profile events per task attempt and 100,000 dead actors
# in the GCS. Actors whose task events are off (Serve's, ours) still report profile events (an idle Serve app's,
# ~30 a second), under task attempts without task info that the state API never lists; with every fault more of
# them filled to 1000 events: the GCS's largest growth in the chaos soak (bench/README.md, "What grows, and why").
RAY_CONFIG = {"task_events_max_num_profile_events_per_task": 20, "maximum_gcs_destroyed_actor_cached_count": 1000}
# The GCS's allocator (the jemalloc Ray preloads), as k8s/ sets it on the head container: one arena and dirty pages
# returned after 1 s. With Ray's defaults (4 arenas per core, dirty pages kept 10 s) its live heap stayed flat in
# ten-minute chaos soaks while its RSS grew with every fault, pages of the many arenas left partly used
# (bench/README.md, "The GCS's allocator"). Ray hands RAY_JEMALLOC_CONF to the processes RAY_JEMALLOC_PROFILE names
# as MALLOC_CONF: despite its name, no profiling unless the conf asks for it.
GCS_MALLOC_ENV = {"RAY_JEMALLOC_PROFILE": "gcs_server",
                  "RAY_JEMALLOC_CONF": "narenas:1,dirty_decay_ms:1000,muzzy_decay_ms:0"}


@dataclass
class MultiNode:
    """A started cluster, its named worker nodes, and (once `serve`d) the app's base URL."""

    cluster: Any
    nodes: dict[str, Any] = field(default_factory=dict)
    url: str = ""
    lost_at: float = 0.0  # wall-clock time of the last node loss (records' timestamps are wall clock)

    def add(self, name: str, cpus: int, resources: dict[str, float] | None = None) -> str:
        """A worker node named `name` (for the test's own bookkeeping); returns its Ray node id."""
        node = self.cluster.add_node(num_cpus=cpus, resources=resources or {}, object_store_memory=OBJECT_STORE)
        self.nodes[name] = node
        self.cluster.wait_for_nodes()
        return node.node_id

    def remove(self, name: str) -> float:
        """The node lost: every process on it killed at once. The monotonic time of the loss."""
        node = self.nodes.pop(name)
        t, self.lost_at = time.monotonic(), time.time()
        self.cluster.remove_node(node, allow_graceful=False)
        return t

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id


def start(workers: dict[str, tuple[int, dict[str, float]]],
          head_resources: dict[str, float] | None = None, fast_verdict: bool = True) -> MultiNode:
    """Head (0 CPUs, the control resource unless `head_resources` says otherwise) + the named worker nodes
    (cpus, resources), the driver connected to it, with kvfleet's `RAY_CONFIG` and `GCS_MALLOC_ENV` (one already
    in the environment wins: a profiling run's). `fast_verdict`: the GCS marks a lost node dead after 3 missed
    1 s health checks instead of Ray's default 5 missed 3 s ones (a restart waits for that verdict)."""
    import ray
    from ray.cluster_utils import Cluster

    for key, value in GCS_MALLOC_ENV.items():  # the head's processes inherit this process's environment
        os.environ.setdefault(key, value)
    keep_serves_controller_loop()
    head = {CONTROL: 1000} if head_resources is None else head_resources
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "resources": head, "object_store_memory": OBJECT_STORE, "include_dashboard": False,
        "_system_config": {**RAY_CONFIG, **(FAST_NODE_VERDICT if fast_verdict else {})}})
    mn = MultiNode(cluster)
    for name, (cpus, res) in workers.items():
        mn.add(name, cpus, res)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    return mn


def serve(mn: MultiNode, name: str, settings: dict[str, str]) -> str:
    """Run the app on the cluster: Serve's HTTP proxy on the head only (all nodes share 127.0.0.1 here, so a
    proxy per node would fight over the port). Returns its base URL once healthy."""
    from ray import serve as ray_serve

    from deployment import build_app

    port = free_port()
    ray_serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    ray_serve.run(build_app(settings), name=name, route_prefix="/")
    mn.url = f"http://127.0.0.1:{port}"
    wait_healthy(mn.url, START_TIMEOUT_S)
    return mn.url


def shutdown(mn: MultiNode) -> None:
    import ray

    with contextlib.suppress(Exception):
        from ray import serve as ray_serve

        ray_serve.shutdown()
    ray.shutdown()
    mn.cluster.shutdown()


def actor_nodes(prefix: str) -> dict[str, str]:
    """Alive actors whose name starts with `prefix` -> their node id. From the GCS actor table: `ray.util.state`
    would need the dashboard on the head (a process more on 2 cores, and its port shared with other clusters)."""
    from ray._private import state

    return {a["Name"]: a["Address"]["NodeID"] for a in state.actors(actor_state_name="ALIVE").values()
            if (a.get("Name") or "").startswith(prefix)}


def until(what: str, cond, timeout_s: float) -> Any:
    """`cond()`'s first truthy value, polled until `timeout_s` (the cluster recovers on its own time)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = cond()
        except (httpx.HTTPError, ValueError) as e:
            last = repr(e)
        else:
            if last:
                return last
        time.sleep(0.2)  # poll interval
    raise AssertionError(f"{what} did not happen within {timeout_s} s (last: {last!r})")


def health(url: str) -> dict:
    r = httpx.get(f"{url}/health", timeout=10)
    return {**r.json(), "code": r.status_code}


def complete(url: str, prompt: str, stream: bool, **body: Any) -> tuple[str, list[str]]:
    """(the text, the streamed chunks' texts). A stream must end with [DONE] after a finish reason: a cut
    stream fails here."""
    req = {"prompt": prompt, "stream": stream, **body}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=req, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], []
    parts, done, finish = [], False, None
    with httpx.stream("POST", f"{url}/v1/completions", json=req, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                parts.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0].get("finish_reason") or finish
    assert done and finish, f"a cut stream: done={done} finish={finish} after {len(parts)} chunks"
    return "".join(parts), parts
