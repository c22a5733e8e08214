"""The engine deployment's autoscaling policies (deployment/autoscale.py), on AutoscalingContexts built by hand,
and as Serve loads and wraps them: no Ray started."""

import sys
from dataclasses import asdict, fields
from types import SimpleNamespace

import pytest
from ray import cloudpickle
from ray.serve import autoscaling_policy as serve_policy
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from deployment.autoscale import KVAutoscalingPolicy, ThresholdAutoscalingPolicy
from engine.messages import LoadReport

DEPLOYMENT = DeploymentID(name="KVFleetEngine", app_name="kvfleet")


def report(**load: float) -> dict[str, float]:
    """One replica's LoadReport as Serve hands it over (every field, 0 unless given)."""
    return asdict(LoadReport(**{f.name: 0.0 for f in fields(LoadReport)} | load))


def context(reports: list[dict | None] | None, current: int | None = None, target: int | None = None,
            config: AutoscalingConfig | None = None, policy_state: dict | None = None) -> AutoscalingContext:
    """A context with one running replica per entry of `reports` (None: that replica has not reported yet;
    `reports` None: no metrics at all)."""
    n = len(reports or []) if current is None else current
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(n)]
    metrics = None
    if reports is not None:
        metrics = {}
        for replica, load in zip(replicas, reports, strict=False):
            for name, value in (load or {}).items():
                metrics.setdefault(name, {})[replica] = value
    config = config or AutoscalingConfig(min_replicas=1, max_replicas=8)
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
        current_num_replicas=n, target_num_replicas=n if target is None else target, running_replicas=replicas,
        total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=dict(policy_state or {}), last_scale_up_time=None, last_scale_down_time=None,
        current_time=None, config=config)


# ---- kv ----


def test_kv_prefill_need_scales_up_on_uncached_prompt_tokens():
    policy = KVAutoscalingPolicy(ttft_target_s=2.0)
    # 2 replicas measured 1000 and 3000 tok/s: one replica does 2000 tok/s, 4000 tokens per TTFT target
    loads = [report(uncached_prompt_tokens=9000, prefill_tokens_per_s=1000, slots=16),
             report(uncached_prompt_tokens=9000, prefill_tokens_per_s=3000, slots=16)]
    desired, state = policy(context(loads))
    assert desired == pytest.approx(18000 / 4000)
    assert state["prefill_need"] == pytest.approx(4.5)
    assert state["sequence_need"] == 0.0


def test_kv_cached_prompt_tokens_cost_nothing():
    """The same requests with their prompts uncached need 5 replicas; held in a group's cache, no more than 1."""
    def loads(uncached: float) -> list[dict]:
        return [report(uncached_prompt_tokens=uncached, prefill_tokens_per_s=2000, running=4, slots=16)] * 2

    assert KVAutoscalingPolicy()(context(loads(10000)))[0] == pytest.approx(5.0)
    desired, state = KVAutoscalingPolicy()(context(loads(0)))
    assert state["prefill_need"] == 0.0
    assert desired == 1


def test_kv_sequence_need_scales_up_on_running_and_waiting():
    policy = KVAutoscalingPolicy(target_occupancy=0.5)
    loads = [report(running=8, waiting=12, slots=8), report(running=8, waiting=4, slots=8)]
    desired, state = policy(context(loads))
    assert state["sequence_need"] == pytest.approx(32 / (8 * 0.5))
    assert desired == pytest.approx(8.0)


def test_kv_takes_the_larger_need():
    policy = KVAutoscalingPolicy(ttft_target_s=1.0, target_occupancy=1.0)
    loads = [report(uncached_prompt_tokens=3000, prefill_tokens_per_s=1000, running=2, slots=4)]
    desired, state = policy(context(loads))
    assert (state["prefill_need"], state["sequence_need"]) == (pytest.approx(3.0), pytest.approx(0.5))
    assert desired == pytest.approx(3.0)


def test_kv_scales_down_with_headroom_and_never_below_one():
    policy = KVAutoscalingPolicy(target_occupancy=1.0, downscale_margin=0.8)
    # 4 replicas, 10 slots each, 16 requests: 1.6 replicas' worth; with headroom ceil(1.6 / 0.8) = 2
    loads = [report(running=4, slots=10)] * 4
    assert policy(context(loads))[0] == 2
    # 2.5 replicas' worth: ceil(3.125) = 4, so no scale-down (not a scale-up either)
    loads = [report(running=6, waiting=0.25, slots=10)] * 4
    assert policy(context(loads))[0] == 4
    # idle: one replica stays
    assert policy(context([report(slots=10)] * 3))[0] == 1


def test_kv_short_groups_force_one_more_replica():
    policy = KVAutoscalingPolicy()
    light = report(running=1, slots=16, kv_usage=0.99)
    assert policy(context([light, light, light]))[0] == 1  # by the sequence need alone: scale down
    desired, state = policy(context([light, report(running=1, slots=16, short_groups=0.4), light]))
    assert desired == 4
    assert state["short_groups"] == pytest.approx(0.4)


def test_kv_short_groups_count_from_the_running_replicas_not_the_target():
    """A replica already starting (target 3, 2 running) is the one more: a scale-up again would overshoot."""
    loads = [report(running=1, slots=16, short_groups=1.0), report(running=1, slots=16)]
    assert KVAutoscalingPolicy()(context(loads, target=3))[0] == 3


def test_kv_prefill_rate_falls_back_to_the_setting_until_measured():
    loads = [report(uncached_prompt_tokens=6000, slots=16), report(uncached_prompt_tokens=6000, slots=16)]
    # nothing measured, no fallback: the prefill term is 0 and idle slots scale down
    desired, state = KVAutoscalingPolicy()(context(loads))
    assert (desired, state["prefill_need"]) == (1, 0.0)
    # nothing measured: the fallback rate, 1000 tok/s x 2 s per replica
    desired, state = KVAutoscalingPolicy(prefill_tokens_per_s=1000)(context(loads))
    assert state["prefill_need"] == pytest.approx(6.0)
    assert desired == pytest.approx(6.0)
    # one replica measured 3000 tok/s: that wins over the fallback, the unmeasured (0) one is left out
    loads[0] = report(uncached_prompt_tokens=6000, slots=16, prefill_tokens_per_s=3000)
    desired, state = KVAutoscalingPolicy(prefill_tokens_per_s=1000)(context(loads))
    assert state["prefill_need"] == pytest.approx(2.0)


def test_kv_without_reports_keeps_the_target():
    policy = KVAutoscalingPolicy(prefill_tokens_per_s=1000)
    assert policy(context(None, current=3, target=4)) == (4, {})
    assert policy(context([], current=3, target=3)) == (3, {})
    assert policy(context([None, None], current=2, target=2)) == (2, {})


def test_kv_counts_only_the_replicas_that_reported():
    """A new replica not yet reported: the others' load over the others' slots."""
    loads = [report(running=20, slots=10), None, None]
    desired, state = KVAutoscalingPolicy(target_occupancy=1.0)(context(loads))
    assert state["sequence_need"] == pytest.approx(2.0)
    assert desired == 3  # 2 < 3 running: ceil(2 / 0.8) = 3, no change


def test_kv_holds_while_no_slot_is_up():
    """Every dp group restarting reports 0 slots: capacity unknown, so no scale-down to 1."""
    loads = [report(waiting=30, slots=0)] * 3
    desired, state = KVAutoscalingPolicy()(context(loads))
    assert (desired, state["sequence_need"]) == (3, 3.0)


def test_kv_rejects_bad_settings():
    with pytest.raises(ValueError):
        KVAutoscalingPolicy(ttft_target_s=0)
    with pytest.raises(ValueError):
        KVAutoscalingPolicy(downscale_margin=1.5)


# ---- threshold ----


def test_threshold_scales_up_on_kv_or_queue():
    policy = ThresholdAutoscalingPolicy()
    # spare KV = 0.80 - 0.75 = 0.05 < 0.10
    desired, state = policy(context([report(kv_usage=0.7), report(kv_usage=0.8)]))
    assert desired == 3
    assert state["spare_kv"] == pytest.approx(0.05)
    # spare queue = 5 - 2.5 = 2.5 < 3
    assert policy(context([report(kv_usage=0.1, waiting=2), report(kv_usage=0.1, waiting=3)]))[0] == 3


def test_threshold_scales_down_when_one_fewer_keeps_both_spares():
    policy = ThresholdAutoscalingPolicy()
    # 3 replicas at 0.3 usage, 0.5 waiting: on 2, 0.45 usage (spare 0.35) and 0.75 waiting (spare 4.25)
    assert policy(context([report(kv_usage=0.3, waiting=0.5)] * 3))[0] == 2
    # 0.5 usage: on 2 it would be 0.75, spare 0.05 < 0.10: stay
    assert policy(context([report(kv_usage=0.5, waiting=0.5)] * 3))[0] == 3
    # 1 waiting: on 2 it would be 1.5 waiting, spare 3.5; 1.5 waiting: 2.25 on 2, spare 2.75 < 3: stay
    assert policy(context([report(kv_usage=0.1, waiting=1)] * 3))[0] == 2
    assert policy(context([report(kv_usage=0.1, waiting=1.5)] * 3))[0] == 3
    # one replica idle stays one
    assert policy(context([report()]))[0] == 1


def test_threshold_without_reports_keeps_the_target():
    policy = ThresholdAutoscalingPolicy()
    assert policy(context(None, current=2, target=2)) == (2, {})
    assert policy(context([None], current=1, target=2)) == (2, {})


# ---- as Serve runs them ----


def test_serve_wrapper_delays_and_factors_the_kv_decision(monkeypatch):
    """Serve's own `_apply_autoscaling_config` around the policy: a scale-up only after `upscale_delay_s` of
    wanting it, a scale-down after `downscale_delay_s`, each step through the scaling factors."""
    clock = [1000.0]
    monkeypatch.setattr(serve_policy, "time", SimpleNamespace(time=lambda: clock[0]))
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, upscale_delay_s=5, downscale_delay_s=60,
                               upscaling_factor=0.5)
    wrapped = serve_policy._apply_autoscaling_config(KVAutoscalingPolicy(target_occupancy=1.0))
    state: dict = {}

    def tick(loads: list[dict], target: int, dt: float) -> int:
        nonlocal state
        clock[0] += dt
        decision, state = wrapped(context(loads, target=target, config=config, policy_state=state))
        return decision

    busy = [report(running=10, waiting=50, slots=10)] * 2  # 12 replicas' worth
    assert tick(busy, 2, 0) == 2
    assert tick(busy, 2, 4.9) == 2  # not yet 5 s
    assert state["sequence_need"] == pytest.approx(12.0)  # the policy's own state survives the wrapper
    assert tick(busy, 2, 0.2) == 7  # ceil(2 + 0.5 x 10): the factor bounds the step; max_replicas is Serve's clip

    idle = [report(running=1, slots=10)] * 4
    assert tick(idle, 4, 1) == 4
    assert tick(idle, 4, 59) == 4
    assert tick(idle, 4, 1.5) == 1
    # the want must last: an interruption (load back) restarts the 60 s
    assert tick(idle, 4, 30) == 4
    assert tick(busy[:1] * 4, 4, 1) == 4
    assert tick(idle, 4, 31) == 4


def test_serve_loads_the_policy_by_value_and_instantiates_it_with_its_kwargs(monkeypatch):
    kwargs = {"ttft_target_s": 1.0, "prefill_tokens_per_s": 500.0, "target_occupancy": 0.5, "downscale_margin": 0.9}
    policy = AutoscalingPolicy(policy_function="deployment.autoscale:KVAutoscalingPolicy", policy_kwargs=kwargs)
    assert policy.policy_function == "deployment.autoscale:KVAutoscalingPolicy"
    assert not policy.is_default_policy_function()
    # Serve's controller may have none of kvfleet's packages: the pickle must not refer to them
    for name in ("deployment", "deployment.autoscale", "engine", "engine.messages"):
        monkeypatch.setitem(sys.modules, name, None)
    loaded = cloudpickle.loads(policy.get_serialized_policy_def())
    instance = _resolve_policy_callable(AutoscalingPolicy.from_serialized_policy_def(
        {"policy_function": policy.policy_function, "policy_kwargs": kwargs}, policy.get_serialized_policy_def()))
    monkeypatch.undo()
    assert loaded.__name__ == "KVAutoscalingPolicy"
    assert type(instance).__name__ == "KVAutoscalingPolicy"
    assert (instance.ttft_target_s, instance.prefill_tokens_per_s) == (1.0, 500.0)
    loads = [report(uncached_prompt_tokens=2000, running=1, slots=4)]
    desired, state = instance(context(loads))
    assert state["prefill_need"] == pytest.approx(2000 / (500 * 1.0))
    assert desired == pytest.approx(4.0)


def test_serve_loads_the_threshold_policy_too():
    policy = AutoscalingPolicy(policy_function="deployment.autoscale:ThresholdAutoscalingPolicy",
                               policy_kwargs={"kv_threshold": 0.9})
    instance = _resolve_policy_callable(policy)
    assert instance.kv_threshold == 0.9
    assert instance(context([report(kv_usage=0.85)]))[0] == 2


def test_kv_demand_need_grows_the_fleet_with_the_arrivals_before_a_queue_forms():
    # no backlog yet, but uncached prompt tokens arrive at 3x what one replica prefills at the target occupancy
    loads = [report(uncached_prompt_tokens_per_s=2400, prefill_tokens_per_s=1000, slots=16)] * 2
    desired, state = KVAutoscalingPolicy()(context(loads))
    assert state["prefill_need"] == 0 and state["demand_need"] == pytest.approx(4800 / 800)
    assert desired == pytest.approx(6.0)
    # in a trough the arrivals keep what they need: 1.5 replicas' worth does not shrink to one
    loads = [report(uncached_prompt_tokens_per_s=600, prefill_tokens_per_s=1000, slots=16)] * 2
    desired, _ = KVAutoscalingPolicy()(context(loads))
    assert desired == 2
