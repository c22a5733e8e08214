"""The linear layers of a decode step on CPU: torch's `linear`, the oneDNN-prepacked weight the model's linears
use for batches, and csrc/cpu_ops.cpp's `linear_rows` they use up to `SMALL_ROWS` rows (workers/parallel.py
`Matmul`), in process, one thread by default.

    python bench/linear_bench.py [--rows 1,4,8,16,32,64,256] [--threads 1]

SmolLM2-135M's shapes (30 layers of stacked q/k/v 960x576, o 576x576, stacked gate/up 3072x576, down 576x1536,
and the LM head 49152x576), a different random weight per layer so the step reads ~0.5 GB as a model's does.
Prints, per batch of rows, the median milliseconds of the 30 layers and of the LM head each way, and the
ratios prepacked / linear and ours / prepacked (ours where the kernel builds). Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workers import cpu_kernels  # noqa: E402
from workers.parallel import PACK_ROWS  # noqa: E402

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of each matmul of a layer
HEAD = (49152, 576)


def timed(calls: list, xs: list[torch.Tensor], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for call, x in zip(calls, xs, strict=True):
            call(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,16,32,64,256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(o, i) for _ in range(args.layers) for o, i in LAYER]
    head = torch.randn(*HEAD)
    packed_ws = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
    packed_head = torch.ops.mkldnn._reorder_linear_weight(head, PACK_ROWS)
    print(f"{args.layers} layers + LM head, {args.threads} thread(s), median of {args.reps}: ms (layers + head)")
    ops = cpu_kernels.cpu_ops()
    print(f"{'rows':>5} {'linear':>16} {'prepacked':>16} {'prepacked/linear':>17} {'ours':>16} {'ours/prepacked':>15}")
    for rows in map(int, args.rows.split(",")):
        xs = [torch.randn(rows, w.shape[1]) for w in weights]
        xh = [torch.randn(rows, HEAD[1])]
        plain = [lambda x, w=w: F.linear(x, w) for w in weights]
        plain_head = [lambda x: F.linear(x, head)]
        packed = [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed_ws]
        packed_h = [lambda x: torch.ops.mkldnn._linear_pointwise(x, packed_head, None, "none", [], "")]
        with torch.inference_mode():
            a, ah = timed(plain, xs, args.reps), timed(plain_head, xh, args.reps)
            b, bh = timed(packed, xs, args.reps), timed(packed_h, xh, args.reps)
        line = f"{rows:>5} {a:>8.1f} + {ah:>5.1f} {b:>8.1f} + {bh:>5.1f} {(b + bh) / (a + ah):>16.2f}x"
        if ops is not None:  # csrc/cpu_ops.cpp's linear_rows: the weight read once for every row
            with torch.inference_mode():
                c = timed([lambda x, w=w: ops.linear_rows(x, w, None) for w in weights], xs, args.reps)
                ch = timed([lambda x: ops.linear_rows(x, head, None)], xh, args.reps)
            line += f" {c:>8.1f} + {ch:>5.1f} {(c + ch) / (b + bh):>14.2f}x"
        print(line)


if __name__ == "__main__":
    main()
