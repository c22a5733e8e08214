"""The step transports' rules without a Ray cluster: one entry per rank, None for a rank not stepped, a
RayActorError for a rank with no actor, a step's exception as that rank's entry."""

import asyncio
import types

import pytest
import ray

from engine.transport import ActorCalls, make_transport
from workers.step import StepPlan


class FakeRank:
    def __init__(self, fail: bool = False) -> None:
        self.plans: list[StepPlan] = []

        async def step(plan):
            self.plans.append(plan)
            if fail:
                raise ValueError("the step raised")
            return ("stepped", plan.iteration)

        self.step = types.SimpleNamespace(remote=step)


def test_actor_calls_give_one_entry_per_rank():
    ranks = [FakeRank(), FakeRank(fail=True), None, FakeRank()]
    transport = make_transport("actor_calls", ranks)
    assert isinstance(transport, ActorCalls)
    out = asyncio.run(transport.step([StepPlan(3), StepPlan(3), StepPlan(3), None]))
    assert out[0] == ("stepped", 3)
    assert isinstance(out[1], ValueError)
    assert isinstance(out[2], ray.exceptions.RayActorError), "a rank with no actor counts as gone"
    assert out[3] is None and ranks[3].plans == [], "a rank with no plan is not stepped"


def test_replace_changes_the_ranks_stepped():
    first, second = FakeRank(), FakeRank()
    transport = make_transport("actor_calls", [first])
    transport.replace([second])
    asyncio.run(transport.step([StepPlan(0)]))
    assert first.plans == [] and len(second.plans) == 1


def test_an_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="compiled_graph, actor_calls"):
        make_transport("carrier_pigeon", [])
