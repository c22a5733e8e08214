"""A rank's CPU threads for a step (workers/parallel.py): the cores it is offered for a step foreseen long enough
to gain from them (in thread-seconds: the choice does not flip with the time the threads save), else its own."""

import math

import torch

from deployment.settings import Settings
from tests.support.engine_harness import make_rank
from workers.parallel import SHARE_CORES_MIN_S, expected_work_s, set_cpu_threads
from workers.sampling_params import SamplingParams
from workers.step import NewRequest, StepPlan, Work


def test_a_rank_takes_the_offered_cores_only_for_a_long_enough_step():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        set_cpu_threads(2, 1, SHARE_CORES_MIN_S)
        assert torch.get_num_threads() == 2
        set_cpu_threads(2, 1, SHARE_CORES_MIN_S / 3)  # a short step: the engine's processes need the cores more
        assert torch.get_num_threads() == 1
        set_cpu_threads(0, 1, 1.0)  # nothing offered: its own
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_step_is_foreseen_from_the_last_that_ran_tokens():
    assert expected_work_s(None, 1) == math.inf  # no step yet: most likely a prompt's prefill
    assert expected_work_s((0.06, 1), 1) == 0.06
    assert expected_work_s((0.06, 1), 256) == 0.06 * 256  # a prefill after a lone decode
    assert expected_work_s((1.0, 256), 1) == 1.0  # a decode after a prefill: never foreseen shorter
    assert expected_work_s((0.01, 4), 0) == 0.01


def test_a_prefill_after_a_close_only_step_takes_the_offered_cores():
    """The step that closes a finished request runs no tokens and takes ~1 ms; the prefill after it is judged
    by the request's last decode, not by that (it ran on one thread, at 1.8x its time on two)."""
    before = torch.get_num_threads()
    try:
        w = make_rank(Settings(model="random", dp=1).engine_config(), 0)
        w.spec.num_threads = 1
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        res = w.step(StepPlan(0, [NewRequest("a", list(range(5, 37)), params)], [Work("a", 32)], threads=2))
        assert torch.get_num_threads() == 2  # the rank's first step
        w.last_work = (SHARE_CORES_MIN_S * 2, 1)  # a lone decode of SmolLM2: ~60 thread-ms
        w.step(StepPlan(1, [], [], close=["a"], threads=2))  # close only: no tokens, not counted
        assert w.last_work == (SHARE_CORES_MIN_S * 2, 1)
        torch.set_num_threads(1)
        w.step(StepPlan(2, [NewRequest("b", list(range(9, 41)), params)], [Work("b", 32)], threads=2))
        assert torch.get_num_threads() == 2
        w.last_work = (SHARE_CORES_MIN_S / 4, 32)  # a short step: the next, no longer, keeps the rank's own
        w.step(StepPlan(3, [], [Work("b", 1, res.ran["a"][1])], threads=2))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
