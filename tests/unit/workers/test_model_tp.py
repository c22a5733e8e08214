"""Tensor parallelism over gloo in two real processes: tp=2 matches tp=1; a missing peer fails clearly."""

import dataclasses
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.gguf_support import TINY, tiny_hf_weights, write_gguf
from tests.support.model_support import greedy, make_manager, save_hf_model, teacher_forced_logits
from workers.loader import load_model
from workers.parallel import destroy_tp_group, free_port, init_tp_group, node_ip

SEQ = [int(x) for x in torch.randint(0, 97, (80,), generator=torch.Generator().manual_seed(3))]
PROMPT = SEQ[:50]


def _run_models(ckpt: str, tp_rank: int, tp_size: int) -> dict:
    out = {}
    gguf = str(Path(ckpt).parent / "tiny.gguf")  # Q8_0, written beside it: each rank dequantizes only its rows
    for name, path in (("builtin", None), ("qwen3", ckpt), ("gguf", gguf)):
        model, cfg = load_model(path, tp_rank=tp_rank, tp_size=tp_size, max_seq_len=128)
        mgr = make_manager(cfg, tp_size=tp_size, max_seq_len=128)
        out[name] = {
            "logits": teacher_forced_logits(model, mgr, SEQ, [9, 30]),
            "greedy": greedy(model, mgr, PROMPT, 12, chunk=16),
        }
    return out


def _tp_worker(rank: int, world: int, port: int, ckpt: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_tp_group(rank, world, "127.0.0.1", port, "gloo", timeout_s=60)
    try:
        torch.save(_run_models(ckpt, rank, world), f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_tp_group()


@pytest.mark.slow  # two processes loading two models each: ~40 s on an idle 2-core machine
def test_tp2_matches_tp1(tmp_path):
    ckpt = tmp_path / "qwen3"
    save_hf_model("qwen3", ckpt, seed=4, attention_bias=True, use_sliding_window=True, sliding_window=6,
                  layer_types=["full_attention", "sliding_attention", "full_attention"])
    cfg = dataclasses.replace(TINY, vocab_size=97)
    write_gguf(tmp_path / "tiny.gguf", tiny_hf_weights(cfg, seed=5), cfg, quant="Q8_0")
    ctx = mp.spawn(_tp_worker, args=(2, free_port(), str(ckpt), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("tp workers did not finish within 240 s")
    ref = _run_models(str(ckpt), 0, 1)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name in ("builtin", "qwen3", "gguf"):
        # every rank returns the same logits (replicated head after the all-reduce)
        assert torch.equal(ranks[0][name]["logits"], ranks[1][name]["logits"])
        assert ranks[0][name]["greedy"] == ranks[1][name]["greedy"] == ref[name]["greedy"]
        torch.testing.assert_close(ranks[0][name]["logits"], ref[name]["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("rank,timeout_s,message", [
    (0, 2.0, r"127\.0\.0\.1:{port}: rank\(s\) \[1\] of world_size 2 did not join"),  # a peer never came
    (1, 1.5, r"rank 1 could not reach tp rank 0 \(the master\) at 127\.0\.0\.1:{port}"),  # no master
], ids=["missing-peer", "missing-master"])
def test_a_missing_rank_fails_within_the_timeout_naming_it(rank, timeout_s, message):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=message.format(port=port)):
        init_tp_group(rank, 2, "127.0.0.1", port, "gloo", timeout_s=timeout_s)
    assert time.monotonic() - t0 < 2 * timeout_s + 0.5


def test_group_arguments_are_checked():
    with pytest.raises(ValueError, match="rank 2 is not in"):
        init_tp_group(2, 2, "127.0.0.1", 1, "gloo")
    with pytest.raises(ValueError, match="backend must be"):
        init_tp_group(0, 2, "127.0.0.1", 1, "mpi")
    single = init_tp_group(0, 1, "127.0.0.1", 1)
    assert single.world_size == 1 and single.group is None


def test_helpers():
    port = free_port()
    assert 0 < port < 65536
    ip = node_ip()
    assert ip.count(".") == 3
