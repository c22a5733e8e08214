"""Rank groups on the session Ray cluster: what a launch leaves behind when it does not finish."""

import asyncio

import pytest

pytestmark = [pytest.mark.ray]


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
