"""A rank's CPU threads for a step (workers/parallel.py): the cores it is offered after a step long enough to gain
from them, else its own."""

import torch

from workers.parallel import SHARE_CORES_MIN_S, set_cpu_threads


def test_a_rank_takes_the_offered_cores_only_after_a_long_enough_step():
    before = torch.get_num_threads()
    try:
        set_cpu_threads(2, 1, SHARE_CORES_MIN_S)
        assert torch.get_num_threads() == 2
        set_cpu_threads(2, 1, SHARE_CORES_MIN_S / 3)  # a short step: the engine's processes need the cores more
        assert torch.get_num_threads() == 1
        set_cpu_threads(0, 1, 1.0)  # nothing offered: its own
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
