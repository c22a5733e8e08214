"""Kernels of our own for CPU fp32: paged decode attention, where torch has none that reads a block table in
place, and the small operators of a forward pass fused.

Each builds once per machine (torch's cpp_extension caches it in TORCH_EXTENSIONS_DIR; the first build is
slow, so `make venv` builds them, and a CPU rank loads them in its setup), or is None where it cannot be
built (no C++ compiler): the model then runs torch's operators as before.
- `cpu_decode_kernel()`: csrc/paged_attention.cpp's decode attention; without it the model gathers the
  blocks. GPUs keep the gather path (torch's SDPA kernels there; a paged kernel for them is FlexAttention's
  or vLLM's, not this one). `cpu_paged_write()`: the same file's writer of a step's new K and V.
- `cpu_ops()`: csrc/cpu_ops.cpp, a forward pass's norms, residual adds, rope and silu * up fused, the matmul
  of a small decode batch (up to 16 rows) at the memory's speed, and the sampler's draw. GPUs keep torch's
  operators.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("kvfleet.worker")

CSRC = Path(__file__).with_name("csrc")
# -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, and without the flag it runs on one thread;
# the simd pragmas vectorize the dot products and sums without -ffast-math's other liberties. glibc declares
# no vector expf without -ffast-math, so the AVX2 paths take csrc/vec_exp.h's exp (pasted in by `_build`)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
OPS = ["linear_rows", "rms_norm", "add_rms_norm_", "rope_", "silu_mul", "sample_rows"]


def _build(name: str, source: str, functions: list[str], cflags: list[str]) -> Any:
    from torch.utils.cpp_extension import load_inline

    text = (CSRC / source).read_text().replace('#include "vec_exp.h"', (CSRC / "vec_exp.h").read_text())
    try:
        return load_inline(name, cpp_sources=[text], functions=functions,
                           extra_cflags=cflags, extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, or a build error: torch's operators still work
        log.warning("CPU kernels %s not built (%s): the model runs torch's operators instead", source,
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None


@functools.cache
def _paged_module() -> Any:
    return _build("kvfleet_paged_attention", "paged_attention.cpp", ["paged_decode", "paged_write"], CFLAGS)


def cpu_decode_kernel() -> Any:
    """`paged_decode(q, k_cache, v_cache, table, lo, len, scale, lse) -> out`, or None (logged once)."""
    module = _paged_module()
    return None if module is None else module.paged_decode


def cpu_paged_write() -> Any:
    """`paged_write(k, v, k_cache, v_cache, slots, offsets)`: new tokens' K and V into their blocks, or None."""
    module = _paged_module()
    return None if module is None else module.paged_write


USE_CPU_OPS = True  # the fused operators where they apply (benchmarks turn them off to compare)


@functools.cache
def cpu_ops() -> Any:
    """The module of csrc/cpu_ops.cpp (`OPS`), or None (logged once). Its elementwise operators round as
    torch's do (-ffp-contract=off: no product fused into a sum)."""
    return _build("kvfleet_cpu_ops", "cpu_ops.cpp", OPS, [*CFLAGS, "-ffp-contract=off"])


def cpu_ops_for(x: Any) -> Any:
    """`cpu_ops()` where its operators apply to `x` (CPU, float32, [rows, n] with contiguous rows), else None:
    torch's operators."""
    if USE_CPU_OPS and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
        return cpu_ops()
    return None


def build_all() -> None:
    """Build (or load) every kernel: `make venv` runs it, so no server's first step waits for a compiler."""
    cpu_decode_kernel()
    cpu_ops()
