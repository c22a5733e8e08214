"""csrc/cpu_ops.cpp against the torch operators it replaces: the elementwise ones to the bit (it is built
without fused multiply-adds), the reductions to fp32's rounding; and the whole model with them on or off."""

import pytest
import torch
import torch.nn.functional as F

from workers import cpu_kernels
from workers.model import apply_rope

ops = cpu_kernels.cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler: the model runs torch's operators")


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 300])  # inline on the calling thread, and split over the threads
def test_rms_norm_and_its_fused_residual_add_match_torch(rows):
    x, res, w = rand(rows, 70), rand(rows, 70, seed=1), rand(70, seed=2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (70,), w, 1e-6), atol=2e-6, rtol=1e-6)
    xs, rs = x.clone(), res.clone()
    ops.add_rms_norm_(xs, rs, w, 1e-6)
    assert torch.equal(rs, res + x)  # the residual stream to the bit
    torch.testing.assert_close(xs, F.rms_norm(res + x, (70,), w, 1e-6), atol=2e-6, rtol=1e-6)


def test_rope_rotates_the_heads_it_is_given_in_place_to_the_bit():
    T, D, heads = 5, 8, 3
    qkv = rand(T, (heads + 2) * D)  # q and k: the first three heads; v after them stays as it was
    cos, sin = rand(T, D, seed=1), rand(T, D, seed=2)
    want = apply_rope(qkv[:, :heads * D].view(T, heads, D), cos, sin).reshape(T, heads * D)
    v = qkv[:, heads * D:].clone()
    ops.rope_(qkv, heads, D, cos, sin)
    assert torch.equal(qkv[:, :heads * D], want)
    assert torch.equal(qkv[:, heads * D:], v)


def test_silu_mul_matches_torch():
    gu = rand(4, 2 * 50)
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(gu[:, :50]) * gu[:, 50:], atol=1e-6, rtol=1e-6)


def test_sample_rows_inverts_each_rows_distribution_at_its_draw_as_torch_does():
    """At a draw in the middle of a token's share of the row, the same token as the torch path (softmax, cumsum,
    searchsorted) picks, at each row's temperature; a draw of 0 or next to 1 never lands on a -inf logit."""
    V = 1000
    x = rand(3, V)  # every token's share of its row well above fp32's rounding of the running sum
    temperature = torch.tensor([1.0, 0.7, 2.5])
    for r in range(3):
        cdf = (x[r] / temperature[r]).softmax(-1).cumsum(-1)
        for token in (0, 17, 500, V - 1):
            lo = cdf[token - 1] if token else torch.tensor(0.0)
            u = torch.full((3,), float((lo + cdf[token]) / 2 / cdf[-1]))
            assert ops.sample_rows(x, temperature, u)[r].item() == token
    masked = torch.full((2, V), float("-inf"))
    masked[:, [3, 600]] = torch.tensor([[1.0, 2.0], [0.5, -3.0]])
    for u in (0.0, 1.0 - 2**-24):
        picks = ops.sample_rows(masked, torch.ones(2), torch.full((2,), u)).tolist()
        assert picks == ([3, 3] if u == 0 else [600, 600])


def test_bad_input_is_refused_with_the_operator_named():
    with pytest.raises(RuntimeError, match="sample_rows: temperature must be > 0"):
        ops.sample_rows(rand(2, 8), torch.tensor([1.0, 0.0]), torch.zeros(2))
    with pytest.raises(RuntimeError, match="sample_rows: temperature and u must be"):
        ops.sample_rows(rand(2, 8), torch.ones(3), torch.zeros(2))
    with pytest.raises(RuntimeError, match="rms_norm: a CPU float32"):
        ops.rms_norm(rand(2, 8).double(), rand(8), 1e-6)
    with pytest.raises(RuntimeError, match="rope_: 3 heads of 8 do not fit"):
        ops.rope_(rand(2, 16), 3, 8, rand(2, 8), rand(2, 8))
    with pytest.raises(RuntimeError, match="linear_rows: x \\[rows, in\\]"):
        ops.linear_rows(rand(2, 8), rand(4, 9), None)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # rope fused, and rope after q/k norms (torch's)
def test_the_model_gives_the_same_greedy_tokens_and_logits_with_the_fused_operators_or_without(
        kind, tmp_path, monkeypatch):
    from tests.support.model_support import greedy, make_manager, save_hf_model, teacher_forced_logits
    from workers.loader import load_model

    save_hf_model(kind, tmp_path)
    model, cfg = load_model(str(tmp_path), max_seq_len=128)
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(21)]

    def run() -> tuple[list[int], torch.Tensor]:  # prefill in two chunks, then lone rows
        return (greedy(model, make_manager(cfg), prompt, 12, chunk=8),
                teacher_forced_logits(model, make_manager(cfg), prompt, [8, 8]))

    fused = run()
    monkeypatch.setattr(cpu_kernels, "USE_CPU_OPS", False)
    plain = run()
    assert fused[0] == plain[0]
    torch.testing.assert_close(fused[1], plain[1], atol=1e-4, rtol=1e-4)
