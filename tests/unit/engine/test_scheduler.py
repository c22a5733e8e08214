"""The step plan's prefill cap: a new prompt goes in chunks beside running decodes while the queue is short."""

from collections import deque

from deployment.settings import Settings
from engine.scheduler import Group, Request, plan_group, prefill_cap
from workers.sampling_params import SamplingParams

CONFIG = Settings(model="random", dp=2, max_num_batched_tokens=1024).engine_config()
CHUNK = 64


def request(rid: str, prompt_len: int, decoding: bool = False) -> Request:
    req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8), None, 8, dp=0)
    if decoding:  # prefilled, its first token sampled: one token to compute a step
        req.created, req.generated, req.num_computed_tokens = True, [7], prompt_len
    return req


def scheduled(plan) -> dict[str, int]:
    return {w.request_id: w.num_scheduled_tokens for w in plan.work}


def test_a_new_prompt_goes_in_chunks_beside_decodes_in_any_group():
    decoding = Group(running=[request("d0", 20, decoding=True), request("d1", 30, decoding=True)])
    arriving = Group(waiting=deque([request("new", 300)]))
    groups = [arriving, decoding]
    cap = prefill_cap(groups, CHUNK)
    assert cap == 64  # the decodes are in the other group: lockstep makes them wait for this one's step too
    assert scheduled(plan_group(arriving, 0, CONFIG, cap=cap)) == {"new": 64}
    assert scheduled(plan_group(decoding, 0, CONFIG, cap=cap)) == {"d0": 1, "d1": 1}  # decodes are never capped
    arriving.running[0].num_computed_tokens = 64
    assert scheduled(plan_group(arriving, 1, CONFIG, cap=prefill_cap(groups, CHUNK))) == {"new": 64}


def test_no_cap_without_decodes_with_a_queue_or_when_turned_off():
    idle = [Group(waiting=deque([request("a", 300)])), Group()]
    assert prefill_cap(idle, CHUNK) == 0  # nothing decodes: the prompt takes the whole budget
    assert scheduled(plan_group(idle[0], 0, CONFIG, cap=0)) == {"a": 300}
    queued = [Group(running=[request("d", 20, decoding=True)],
                      waiting=deque(request(f"w{i}", 300) for i in range(3))), Group()]
    assert prefill_cap(queued, CHUNK) == 0  # three waiting for two groups: throughput first
    assert prefill_cap([Group(running=[request("d", 20, decoding=True)]), Group()], 0) == 0  # turned off

