"""Every package imports, and the layering of DESIGN.md holds (kvcache imports no Ray, no workers)."""

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("name", ["kvcache", "workers", "engine", "aggregator", "deployment"])
def test_package_imports(name):
    assert importlib.import_module(name) is not None


def test_kvcache_imports_no_ray_nor_upper_layers():
    code = (
        "import sys, kvcache; bad = [m for m in ('ray', 'workers', 'aggregator', 'deployment') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_aggregator_never_imports_workers():
    code = "import sys, aggregator; sys.exit(1 if 'workers' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_aggregator_does_not_load_torch():
    """The stats actor shares kvcache's field names but must stay light: no torch in its process."""
    code = "import sys, aggregator, aggregator.merge; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_engine_and_the_messages_to_a_rank_import_no_torch():
    """The engine replica's loop reaches a rank only through workers.step; torch stays inside the ranks."""
    code = ("import sys, engine, engine.core, engine.placement, engine.ranks, engine.transport, engine.recovery, "
            "engine.stats_channel, workers.step, workers.sampling_params, workers.model_setting; "
            "bad = [m for m in ('torch', 'workers.worker', 'workers.model', 'workers.loader') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
