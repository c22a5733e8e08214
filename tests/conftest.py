"""Shared fixtures: one local Ray cluster per test session, sized for a 2-core machine; the tiers' markers.

Tests live by tier: `unit/<package>/` (no Ray), `ray/` (the session's Ray cluster), `e2e/` (the Serve app on
it), `multinode/` (a multi-node cluster of their own); `support/` holds what they share. A test's tier markers
come from its directory (`make test` selects by them); a file adds only its own (`slow`, `gpu`, a timeout).
"""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# CI explores the same examples every run (a new random failure belongs in a dev run, not a landing), and a
# loaded 2-core machine must not turn slow examples into failures.
settings.register_profile("ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


TESTS = Path(__file__).resolve().parent
TIER_MARKS = {"e2e": ("e2e", "ray"), "ray": ("ray",), "multinode": ("multinode",)}


def pytest_itemcollected(item):
    """The tier's markers from the test's directory, before `-m` selects."""
    tier = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
    for name in TIER_MARKS.get(tier, ()):
        item.add_marker(name)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: only the tests that will run decide the skip
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    cuda = _has_cuda()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)
    # A multi-node test starts its own ray.cluster_utils.Cluster and connects this process to it; Ray allows one
    # ray.init per process, and the session `ray_cluster` below stays up until the session ends. So the
    # multi-node tests run in a pytest process of their own (`pytest -m multinode`; the Makefile's `test` runs
    # two processes), and are skipped in one that also runs tests on the session cluster.
    shared = any("ray_cluster" in getattr(item, "fixturenames", ()) for item in items)
    if shared:
        skip_mn = pytest.mark.skip(reason="multi-node tests need a pytest process of their own: pytest -m multinode")
        for item in items:
            if "multinode" in item.keywords:
                item.add_marker(skip_mn)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test that needs Ray (logical CPUs > cores: actors mostly wait)."""
    import ray

    from tests.support.e2e_fixtures import keep_serves_controller_loop

    keep_serves_controller_loop()
    if not ray.is_initialized():
        ray.init(
            # always a cluster of its own: without an address ray.init() joins the cluster named in
            # /tmp/ray/ray_current_cluster, which a multi-node cluster (tests/support/multinode_support.py, the chaos
            # soak)
            # on this machine writes
            address="local",
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            object_store_memory=200 * 1024 * 1024,
        )
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()


# the e2e tests' one Serve app: defined here once, since a fixture imported into several test modules is set up
# once per module (three deployments of the same app)
from tests.support.e2e_fixtures import serve_app  # noqa: E402, F401

# transformers' reference for the packaged SmolLM2 file (~20 s to load on 2 cores): here for the same reason, so
# the unit and e2e modules that compare with it share one load
from tests.support.gguf_support import hf_model, hf_tokenizer, smollm2_path  # noqa: E402, F401

# the HTTP route tests' fake app (module-scoped: one uvicorn server per test module that asks for it)
from tests.support.http_support import http, server  # noqa: E402, F401
