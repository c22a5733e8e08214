"""A rank's CPU threads for a step (workers/parallel.py): the cores it is offered after a step long enough to gain
from them (in thread-seconds: the choice does not flip with the time the threads save), else its own."""

import torch

from workers.parallel import SHARE_CORES_MIN_S, set_cpu_threads


def test_a_rank_takes_the_offered_cores_only_after_a_long_enough_step():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        set_cpu_threads(2, 1, SHARE_CORES_MIN_S)
        assert torch.get_num_threads() == 2
        set_cpu_threads(2, 1, SHARE_CORES_MIN_S / 3)  # a short step: the engine's processes need the cores more
        assert torch.get_num_threads() == 1
        set_cpu_threads(0, 1, 1.0)  # nothing offered: its own
        assert torch.get_num_threads() == 1
        set_cpu_threads(2, 1, SHARE_CORES_MIN_S * 1.2)  # long enough on one thread: two
        assert torch.get_num_threads() == 2
        set_cpu_threads(2, 1, SHARE_CORES_MIN_S * 0.7)  # the same step, faster on two, keeps them
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
