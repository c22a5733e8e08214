"""Kernels of our own for paged attention, where torch has none that reads a block table in place.

`cpu_decode_kernel()` builds (once per machine: torch's cpp_extension caches it in TORCH_EXTENSIONS_DIR; the
first build is slow, so `make venv` builds it, and a CPU rank loads it in its setup) and returns the
CPU decode attention of csrc/paged_attention.cpp, or None where it cannot be built (no C++ compiler): the
model then gathers the blocks as before. GPUs keep the gather path
(torch's SDPA kernels there; a paged kernel for them is FlexAttention's or vLLM's, not this one).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("kvfleet.worker")

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
# -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, and without the flag it runs on one thread;
# the simd pragmas vectorize the dot products and sums without -ffast-math's other liberties; -fno-math-errno
# lets the softmax's exp vectorize (glibc's libmvec)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


@functools.cache
def cpu_decode_kernel() -> Any:
    """`paged_decode(q, k_cache, v_cache, table, lo, len, scale) -> out`, or None (logged once)."""
    from torch.utils.cpp_extension import load_inline

    try:
        module = load_inline("kvfleet_paged_attention", cpp_sources=[SOURCE.read_text()],
                             functions=["paged_decode"], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, or a build error: the gather path still works
        log.warning("paged decode kernel not built (%s): decode attention gathers the blocks instead",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None
    return module.paged_decode
