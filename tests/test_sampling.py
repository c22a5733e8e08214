"""SamplingParams validation and the sampler: greedy, top-k/top-p support, seeds, distribution."""

import pytest
import torch

from workers.sampling import make_generator, sample
from workers.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k must be an integer >= 0"),
    (dict(seed="7"), "seed must be an integer or None"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids must be non-negative integers"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list"),
    (dict(ignore_eos="yes"), "ignore_eos must be a boolean"),
])
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams(stop_token_ids=[3, 4], top_k=-1)
    assert p.stop_token_ids == (3, 4) and p.max_tokens == 16 and not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert make_generator(p) is None
    g = make_generator(SamplingParams(seed=5))
    assert torch.randint(0, 100, (3,), generator=g).tolist() == torch.randint(
        0, 100, (3,), generator=torch.Generator().manual_seed(5)).tolist()


def _logits(n=4, v=50, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = _logits()
    assert sample(x, [SamplingParams(temperature=0)] * 4, [None] * 4) == x.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy():
    x = _logits()
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    assert sample(x, [SamplingParams(top_k=1)] * 4, gens) == x.argmax(-1).tolist()
    assert sample(x, [SamplingParams(top_p=1e-6)] * 4, gens) == x.argmax(-1).tolist()


def test_top_k_limits_the_support():
    x = _logits(1, 50, seed=3)
    allowed = set(x[0].topk(5).indices.tolist())
    g = torch.Generator().manual_seed(0)
    picks = {sample(x, [SamplingParams(top_k=5, temperature=5.0)], [g])[0] for _ in range(200)}
    assert picks <= allowed and len(picks) >= 4


def test_top_p_keeps_the_smallest_set_reaching_p():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    picks = {sample(x, [SamplingParams(top_p=0.8)], [g])[0] for _ in range(200)}
    assert picks == {0, 1}  # 0.5 < 0.8 <= 0.5 + 0.3
    picks = {sample(x, [SamplingParams(top_p=0.81)], [g])[0] for _ in range(200)}
    assert picks == {0, 1, 2}


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    x = _logits(3, 50, seed=1)
    p = SamplingParams(temperature=1.0, seed=11)

    def draws(batch_rows, params):
        g = [make_generator(q) for q in params]
        out = []
        for _ in range(20):
            out.append(sample(x[batch_rows], params, g))
        return out

    alone = [row[0] for row in draws([0], [p])]
    mixed = [row[1] for row in draws([2, 0, 1], [SamplingParams(), p, SamplingParams(temperature=0)])]
    assert alone == mixed
    assert len(set(alone)) > 1  # really sampled


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    x = torch.log(probs)[None]
    g = torch.Generator().manual_seed(0)
    n = 3000

    def freqs(params):
        picks = sample(x.expand(n, 3), [params] * n, [g] * n)
        return torch.bincount(torch.tensor(picks), minlength=3) / n

    assert torch.allclose(freqs(SamplingParams()), probs, atol=0.03)
    sharp = probs**2 / (probs**2).sum()  # temperature 0.5 sharpens: p^2 normalised
    assert torch.allclose(freqs(SamplingParams(temperature=0.5)), sharp, atol=0.03)
    torch.manual_seed(0)  # rows without a generator: one batched draw from the global RNG
    shared = torch.tensor(sample(x.expand(n, 3), [SamplingParams()] * n, None))
    assert torch.allclose(torch.bincount(shared, minlength=3) / n, probs, atol=0.03)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        sample(torch.zeros(5), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="2 logits rows but 1 params"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None])
