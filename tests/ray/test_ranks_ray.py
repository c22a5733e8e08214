"""Rank groups on the session Ray cluster: what a launch leaves behind when it does not finish."""

import asyncio

import pytest


def test_a_launch_cancelled_while_its_group_waits_for_placement_removes_the_group(ray_cluster):
    from ray.util import placement_group_table

    from deployment.settings import Settings
    from engine import ranks

    s = Settings(model="random", engine_id="unplaceable", dp=1, tp=1, device="cpu", num_cpus_per_rank=64)
    name = ranks.pg_name("unplaceable", 0)

    async def main():
        launch = asyncio.ensure_future(ranks.start_group(s.engine_config(), 0, "cpu", "float32"))
        await asyncio.sleep(0)  # the launch has asked Ray for its group (64 CPUs: it stays pending) and waits
        assert [i["state"] for i in placement_group_table().values() if i.get("name") == name] == ["PENDING"]
        launch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await launch

    asyncio.run(main())
    assert [i["state"] for i in placement_group_table().values() if i.get("name") == name] == ["REMOVED"]


def _exported_actor_classes() -> int:
    import ray

    return len(ray._private.worker.global_worker.gcs_client.internal_kv_keys(b"ActorClass", b"fun"))


def test_rank_groups_record_no_task_events_and_export_their_class_once(ray_cluster):
    """What each fault's group restart left in the GCS until the job ended: the rank class exported again (a new
    class id per `ray.remote`, ~19 KB), and the task events of every call (a /health probe's too), up to 100,000.
    Task events are off for the whole actor, as for Serve's actors, in the handle the engine makes and in one
    found by name."""
    import ray

    from aggregator import aggregator_name, get_or_create_aggregator
    from aggregator.actor import NAMESPACE
    from deployment.settings import Settings
    from engine import ranks

    s = Settings(model="random", engine_id="no-task-events", dp=1, tp=1, device="cpu", num_cpus_per_rank=0.1)

    def group():
        return asyncio.run(ranks.start_group(s.engine_config(), 0, "cpu", "float32"))

    agg = get_or_create_aggregator("no-task-events", world_size=1, tp=1)
    pg, workers = group()
    exported = _exported_actor_classes()
    ranks.stop(workers, [pg])
    pg, workers = group()
    try:
        assert _exported_actor_classes() == exported  # the restarted group's class is the one exported
        found = ray.get_actor(aggregator_name("no-task-events"), namespace=NAMESPACE)
        for handle in (*workers, agg, found):
            assert handle._ray_enable_task_events is False
        assert ray.get(found.health.remote())  # the handle found by name works
    finally:
        ranks.stop(workers, [pg])
        ray.kill(agg)
