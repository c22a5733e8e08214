"""Settings, the app builder, `serve build`, and the README's settings table (all without a Ray cluster)."""

import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from deployment.build import build_app, parse_settings
from deployment.ingress.serve import KVFleetIngress
from deployment.settings import Settings, settings_table_markdown

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_builder_args_are_parsed_and_override_env(monkeypatch):
    monkeypatch.setenv("KVFLEET_TP", "4")
    monkeypatch.setenv("KVFLEET_MAX_SEQ_LEN", "256")
    s = parse_settings({"tp": "2", "enable-block-reuse": "false", "host_cache_bytes": "0"})
    assert (s.tp, s.max_seq_len, s.enable_block_reuse, s.host_cache_bytes) == (2, 256, False, 0)


def test_defaults_are_the_cpu_demo(monkeypatch):
    for name in Settings.model_fields:
        monkeypatch.delenv(f"KVFLEET_{name.upper()}", raising=False)
    s = parse_settings({})
    assert (s.dp, s.tp, s.model, s.device, s.max_num_seqs) == (1, 1, "smollm2-135m-instruct", "auto", 128)
    assert s.served_model_name == "smollm2-135m-instruct"  # follows the model unless set


@pytest.mark.parametrize("args,needle", [
    ({"tpp": "2"}, "tpp"), ({"tp": "zero"}, "tp"), ({"dp": "0"}, "dp"), ({"device": "tpu"}, "device"),
])
def test_bad_builder_args_name_the_setting(args, needle):
    with pytest.raises(ValueError) as exc:
        parse_settings(args)
    assert needle in str(exc.value) and "known settings" in str(exc.value)


def test_build_app_binds_without_starting_ray():
    code = ("import ray, deployment; from ray.serve import Application; "
            "assert isinstance(deployment.app, Application); "
            "assert isinstance(deployment.build_app({'tp': '1'}), Application); "
            "assert not ray.is_initialized(); import sys; "
            "assert 'engine.core' not in sys.modules and 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    app = build_app({"dp": "1"})
    assert app is not None and KVFleetIngress.name == "KVFleetIngress"


@pytest.mark.parametrize("args,needle", [
    ("model={tmp}/missing.gguf", "GGUF file '{tmp}/missing.gguf' does not exist"),
    ("tp=2", "model 'smollm2-135m-instruct': tensor parallelism: num_kv_heads (3) is not divisible by tp_size (2)"),
], ids=["missing-file", "bad-tp"])
def test_serve_run_with_a_bad_model_fails_at_once_naming_it(tmp_path, args, needle):
    """It exited 0 after the engine's constructor had failed three times inside Serve's controller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")} | {"RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [str(pathlib.Path(sys.executable).parent / "serve"), "run", "deployment:build_app",
           args.format(tmp=tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode != 0
    last = (out.stdout + out.stderr).strip().splitlines()[-1]
    assert last.startswith("ValueError: invalid kvfleet settings: ") and needle.format(tmp=tmp_path) in last
    assert "Started a local Ray instance" not in out.stdout + out.stderr  # nothing was deployed


def test_the_default_app_is_built_when_read(monkeypatch, tmp_path):
    import deployment

    monkeypatch.setenv("KVFLEET_MODEL", str(tmp_path / "gone.gguf"))
    monkeypatch.delitem(deployment.__dict__, "app", raising=False)
    with pytest.raises(ValueError, match="gone.gguf' does not exist"):
        deployment.app  # noqa: B018  (what `serve run deployment:app` reads)


def test_settings_table_lists_every_field():
    table = settings_table_markdown()
    for name, field in Settings.model_fields.items():
        assert f"`KVFLEET_{name.upper()}`" in table and field.description in table
    assert table.count("\n") == len(Settings.model_fields) + 2


def test_readme_has_the_current_settings_table():
    readme = ROOT / "README.md"
    if not readme.exists() or "<!-- settings-table -->" not in readme.read_text():
        pytest.skip("README.md has no <!-- settings-table --> marker yet")
    assert settings_table_markdown() in readme.read_text(), (
        "README settings table is stale: paste deployment.settings.settings_table_markdown() after the marker"
    )


def test_serve_build_config_is_valid_and_deployable(tmp_path):
    from ray.serve.schema import ServeDeploySchema

    serve = pathlib.Path(sys.executable).with_name("serve")
    target = tmp_path / "serve.yaml"
    out = subprocess.run([str(serve), "build", "deployment:app", "-o", str(target)], capture_output=True,
                         text=True, cwd=ROOT, timeout=180, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(target.read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "deployment:app" and app.route_prefix == "/"
    deps = {d.name: d for d in app.deployments}
    assert set(deps) == {"KVFleetIngress", "KVFleetEngine"}
    assert deps["KVFleetIngress"].num_replicas == 1 and deps["KVFleetEngine"].num_replicas == 1
    for dep in deps.values():
        assert dep.max_ongoing_requests >= 100 and dep.ray_actor_options.num_cpus < 1
    # What the cluster does with the config: import the path and build the app from `args`.
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.utils import import_attr

    built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args or {})
    assert type(built).__name__ == "Application"



def test_each_engine_replica_is_the_engine_of_its_serve_rank():
    one = parse_settings({"model": "random"})
    assert one.engine_ids() == ["engine-0"] and one.engine_config(0).engine_id == "engine-0"  # today's names
    fleet = parse_settings({"model": "random", "engine_replicas": "3", "engine_id": "e"})
    assert fleet.engine_ids() == ["e-0", "e-1", "e-2"]
    assert [fleet.engine_config(r).engine_id for r in range(3)] == fleet.engine_ids()
    assert fleet.engine_config(3).engine_id == "e-3"  # a surge replica's rank past the count still names one


def test_the_load_weight_defaults_to_the_ranks_device_and_a_set_value_wins():
    from deployment.build import request_router

    def weights(**kw) -> tuple[float, float]:
        s = parse_settings({"engine_replicas": 2, **kw})
        return request_router(s).request_router_kwargs["load_weight"], s.engine_config(0).routing.load_weight

    assert weights(model="random", device="cpu") == (0.5, 0.5)
    assert weights(model="random") == (None, None)  # device=auto: resolved where Ray runs, as the device is
    assert weights(model="random", device="cuda") == (0.1, 0.1)
    assert weights(model="simulated") == (0.1, 0.1)  # a simulated GPU
    assert weights(model="simulated", routing_load_weight=0.3) == (0.3, 0.3)
    assert weights(model="random", routing_load_weight=0) == (0, 0)  # 0 is a value, not "unset"
    with pytest.raises(ValueError, match="routing_load_weight"):
        parse_settings({"routing_load_weight": -1})


def test_fleet_routing_names_serves_routers():
    from deployment.build import request_router

    assert request_router(parse_settings({"model": "random"})) is None  # Serve's own power of two choices
    prefix = request_router(parse_settings({"model": "random", "fleet_routing": "prefix_affinity",
                                            "engine_replicas": 2}))
    assert prefix.request_router_class.endswith("prefix_aware_router:PrefixCacheAffinityRouter")
    kv = request_router(parse_settings({"model": "random", "engine_replicas": 2}))  # the default with a fleet
    assert kv.request_router_class == "deployment.router.request_router:KVFleetRouter"
    assert kv.request_router_kwargs["load_weight"] is None  # device=auto: the router resolves it where it runs
    # one replica: nothing to pick, so no router of ours and no KV stream followed, whatever the setting
    assert request_router(parse_settings({"model": "random", "fleet_routing": "prefix_affinity"})) is None
    assert parse_settings({"model": "random", "engine_replicas": 2}).engine_config(0).kv_events.always
    with pytest.raises(ValueError, match="fleet_routing"):
        parse_settings({"fleet_routing": "kv_magic"})


def test_build_app_slows_serves_controller_loop_for_the_cluster_serve_run_starts(monkeypatch):
    """`serve run` builds the app and then starts Ray, whose processes inherit the builder's environment: the
    controller's loop at 0.5 s (deployment/build.py CONTROLLER_ENV), unless the operator set one."""
    from deployment.build import CONTROLLER_ENV

    name = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
    assert CONTROLLER_ENV == {name: "0.5"}
    monkeypatch.delenv(name, raising=False)
    build_app({})
    assert os.environ[name] == "0.5"
    monkeypatch.setenv(name, "0.2")
    build_app({})
    assert os.environ[name] == "0.2"
