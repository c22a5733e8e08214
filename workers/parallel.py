"""Tensor parallelism: the torch.distributed group of one model copy and the linears that split over it.

`init_tp_group` does its own rendezvous on a `TCPStore` before creating the process group, so a peer that
never starts is reported by rank and address within `timeout_s` instead of hanging in
`init_process_group`. The group it creates is the process's default group: one process = one rank of one
tp group (each dp group gets its own master port). The linears follow Megatron: column-parallel splits the
output features (q/k/v by heads, gate/up by intermediate rows), row-parallel splits the input features and
all-reduces the partial sums. Each parameter carries `shard_dim` (0, 1 or None = replicated) so the loader
can cut the matching slice out of a full checkpoint tensor.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.cpu_kernels import cpu_ops_for

log = logging.getLogger("kvfleet.worker")


@dataclass(frozen=True)
class TPGroup:
    """The tp group this process belongs to (`group` None when `world_size == 1`: no collectives needed)."""

    rank: int
    world_size: int
    backend: str | None
    master_addr: str
    master_port: int
    group: dist.ProcessGroup | None = None


def init_tp_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    timeout_s: float = 60.0,
    *,
    device: str | torch.device | None = None,
    collective_timeout_s: float = 600.0,
) -> TPGroup:
    """Join tp group `rank` of `world_size` whose rank 0 listens on `master_addr:master_port`.

    backend: "nccl" or "gloo"; None = NCCL when CUDA is available, else gloo. `device` (a CUDA device) is made
    current before an NCCL group is created. Every rank must join within `timeout_s` seconds, or every rank
    that did raises RuntimeError naming the missing ranks and the address. Collectives time out after
    `collective_timeout_s`. With `world_size == 1` nothing is initialised (no port is used).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tp group: rank {rank} is not in [0, world_size={world_size})")
    if timeout_s <= 0:
        raise ValueError(f"tp group: timeout_s must be positive, got {timeout_s}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"tp group: backend must be 'nccl' or 'gloo', got {backend!r}")
    if world_size == 1:
        return TPGroup(rank, 1, None, master_addr, master_port)
    if dist.is_initialized():
        raise RuntimeError("tp group: torch.distributed is already initialised in this process")
    where = f"{master_addr}:{master_port}"
    deadline = time.monotonic() + timeout_s
    if rank != 0:  # TCPStore's own connect retries can overshoot the timeout; probe with our deadline first
        _wait_for_listener(master_addr, master_port, deadline, rank)
    timeout = timedelta(seconds=max(0.1, deadline - time.monotonic()))
    try:
        store = dist.TCPStore(
            master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
    except Exception as e:  # connection refused until timeout, or the port is taken
        role = "listen on" if rank == 0 else "reach tp rank 0 (the master) at"
        raise RuntimeError(f"tp group: rank {rank} could not {role} {where} within {timeout_s}s: {e}") from e
    store.set(f"kvfleet/joined/{rank}", node_ip())
    keys = [f"kvfleet/joined/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except Exception as e:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(
            f"tp group at {where}: rank(s) {missing} of world_size {world_size} did not join within "
            f"{timeout_s}s (this is rank {rank})"
        ) from e
    if backend == "nccl" and device is not None:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("kvfleet/pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s),
    )
    log.info("tp group ready: rank %d/%d backend %s master %s", rank, world_size, backend, where)
    return TPGroup(rank, world_size, backend, master_addr, master_port, dist.group.WORLD)


def _wait_for_listener(addr: str, port: int, deadline: float, rank: int) -> None:
    """Poll until something accepts TCP connections on addr:port, or raise at the deadline."""
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((addr, port), timeout=max(0.05, min(1.0, left))).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"tp group: rank {rank} could not reach tp rank 0 (the master) at "
                    f"{addr}:{port} before the timeout: {e}"
                ) from e
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def group_min(value: int, tp: TPGroup) -> int:
    """The smallest `value` over the tp group (every rank must call it): ranks of one group must agree on
    sizes they derive from their own device (free memory), or their block decisions diverge."""
    if tp.group is None:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if tp.backend == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())


def destroy_tp_group() -> None:
    """Tear down the default process group if one exists (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago (bind to port 0); the caller should use it promptly."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This node's outward-facing IPv4 address (no packet is sent), or 127.0.0.1 without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def param(shape: tuple[int, ...], shard_dim: int | None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.shard_dim = shard_dim  # read by the loader
    return p


# oneDNN's matmul on a weight prepacked in its own blocked layout, for CPU fp32 batches of two rows or more:
# SmolLM2's linears at 8-16 rows (decode batches) took 0.6-0.7x the time of torch's `linear` alone
# (bench/linear_bench.py), a 16-sequence decode step of the whole model 0.93x (it reads the KV cache too:
# decode_bench.py). At one row it is slower on one thread (1.13x) but not on more: torch's `linear` runs a lone
# row on one thread, oneDNN splits it (0.63x on two, linear_bench.py --rows 1 --threads 2). So up to SMALL_ROWS
# rows take csrc/cpu_ops.cpp's `linear_rows` where it is built (it reads the weight as it lies, once for every
# row: 0.78-0.92x oneDNN's at 1-16 rows on two threads, 1.03x at 20, 1.17x at 32), else oneDNN on more than
# one thread or row and `linear` on one. The packed copy is made on first use and doubles the weights' memory on CPU.
PACK_ROWS = 16  # the batch size oneDNN chooses the packed layout for
SMALL_ROWS = 16
_MKLDNN = torch.backends.mkldnn.is_available()


class Matmul:
    """x W^T (+ b), with the oneDNN copy of W it made for the last W it saw."""

    def __init__(self) -> None:
        self._packed: tuple[tuple[int, int], torch.Tensor] | None = None  # (W's identity, W prepacked)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not (w.device.type == "cpu" and w.dtype == torch.float32 and x.dtype == torch.float32):
            return F.linear(x, w, bias)
        if x.shape[0] <= SMALL_ROWS and w.is_contiguous():
            ops = cpu_ops_for(x)
            if ops is not None:  # a small batch: our kernel reads the weight once, at the memory's speed
                return ops.linear_rows(x, w, bias)
        if not (_MKLDNN and (x.shape[0] > 1 or torch.get_num_threads() > 1)):
            return F.linear(x, w, bias)
        key = (w.data_ptr(), w._version)  # weights loaded or tied after the copy was made invalidate it
        if self._packed is None or self._packed[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS))
        return torch.ops.mkldnn._linear_pointwise(x, self._packed[1], bias, "none", [], "")


class Linear(nn.Module):
    """y = x W^T (+ b): what the tensor-parallel linears below share."""

    def __init__(self, out_features: int, in_features: int, shard_dim: int | None, bias: bool,
                 bias_shard_dim: int | None):
        super().__init__()
        self.weight = param((out_features, in_features), shard_dim)
        self.bias = param((out_features,), bias_shard_dim) if bias else None
        self.matmul = Matmul()


class Stacked:
    """Column-parallel linears that read the same input, as one matmul (vLLM's fused QKV and gate/up
    projections): their weights and biases become views of one stacked tensor, which the loader fills through
    their names, and each call returns every linear's output."""

    def __init__(self, *linears: Linear) -> None:
        self.sizes = [lin.weight.shape[0] for lin in linears]
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        biased = [lin.bias is not None for lin in linears]
        if any(biased) and not all(biased):
            raise ValueError("stacked linears must all have a bias or none")
        self.bias = torch.cat([lin.bias.detach() for lin in linears]) if all(biased) else None
        offset = 0
        for lin, n in zip(linears, self.sizes, strict=True):
            lin.weight = _view_param(self.weight[offset:offset + n], lin.weight)
            if self.bias is not None:
                lin.bias = _view_param(self.bias[offset:offset + n], lin.bias)
            offset += n
        self.matmul = Matmul()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.stacked(x).split(self.sizes, dim=-1)

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        """Every linear's output side by side, in their order ([..., sum of sizes])."""
        return self.matmul(x, self.weight, self.bias)


def _view_param(view: torch.Tensor, old: nn.Parameter) -> nn.Parameter:
    p = nn.Parameter(view, requires_grad=False)
    p.shard_dim = old.shard_dim
    return p


class ColumnParallelLinear(Linear):
    """y = x W^T + b with W's output rows split over tp ranks (rank r holds rows [r*out/tp, (r+1)*out/tp))."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int = 0, tp_size: int = 1):
        if out_features % tp_size:
            raise ValueError(f"column-parallel linear: {out_features} outputs not divisible by tp_size {tp_size}")
        super().__init__(out_features // tp_size, in_features, 0, bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T (all-reduce), + b once; x arrives already split by input feature."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
        group: dist.ProcessGroup | None = None,
    ):
        if in_features % tp_size:
            raise ValueError(f"row-parallel linear: {in_features} inputs not divisible by tp_size {tp_size}")
        super().__init__(out_features, in_features // tp_size, 1, bias, None)
        self.tp_size = tp_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.weight, self.bias)
        y = self.matmul(x, self.weight, None)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(Linear):
    """A linear every rank holds whole (the LM head: logits come out identical on every tp rank)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(out_features, in_features, None, bias, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


# a rank whose step will be short keeps its own threads when it may take more (StepPlan.threads): the engine's,
# aggregator's and HTTP processes need the node's cores more than a step that short gains from them (the
# measurements behind it: bench/README.md, engine_bench.py). Counted in thread-seconds (the step's time times the
# threads it ran on), so the choice is the same on either side of it: a lone sequence's decode step of SmolLM2
# takes ~30 ms on two threads and ~42 on one, and by its time alone it flipped every step.
SHARE_CORES_MIN_S = 0.03


def expected_work_s(last: tuple[float, int] | None, tokens: int) -> float:
    """A step's thread-seconds, foreseen from `last` (the thread-seconds and tokens of the last step that ran
    any): as long, or longer in proportion to more tokens (a prompt's prefill after decodes: judged by the
    step before it, a close-only step of 1 ms, a cold 256-token prefill ran on one thread, 1.8x its time on
    two). Never shorter for fewer tokens: a decode token costs far more than a prefill's. No step yet: long."""
    if last is None:
        return math.inf
    work_s, last_tokens = last
    return work_s * max(1.0, tokens / max(1, last_tokens))


def set_cpu_threads(offered: int, own: int, work_s: float) -> None:
    """This process's CPU threads for a rank's step: the `offered` cores (StepPlan.threads) for a step whose
    foreseen thread-seconds (`expected_work_s`) gain from them, else the rank's `own`."""
    threads = offered if offered and work_s >= SHARE_CORES_MIN_S else max(1, own)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
