"""SamplingParams validation and the sampler: greedy, top-k/top-p support, seeds, distribution."""

import pytest
import torch

from workers.sampling import make_generator, penalize, sample
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
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(min_tokens=5, max_tokens=4), r"min_tokens must be an integer in \[0, max_tokens\]"),
    (dict(min_tokens=-1), "min_tokens"),
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


def test_penalties_are_vllms():
    """repetition over prompt and output (positive logits divided, negative multiplied), frequency per output
    occurrence, presence once per output token: each term against the row computed by hand."""
    row = torch.tensor([1.0, 2.0, -2.0, 4.0, 0.5])
    prompt, output = [1, 2], [2, 3, 3]
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    want = torch.tensor([1.0, 2.0 / 2, -2.0 * 2 - 0.5 - 0.25, 4.0 / 2 - 1.0 - 0.25, 0.5])
    assert torch.allclose(penalize(row, p, prompt, output), want)
    assert torch.equal(row, torch.tensor([1.0, 2.0, -2.0, 4.0, 0.5]))  # the input row is left as it was
    only_rep = penalize(row, SamplingParams(repetition_penalty=2.0), prompt, [])
    assert torch.allclose(only_rep, torch.tensor([1.0, 1.0, -4.0, 4.0, 0.5]))  # the prompt alone counts too


def test_a_penalty_changes_the_greedy_pick_and_needs_the_history():
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sample(logits, [greedy]) == [1]
    assert sample(logits, [penalized], histories=[([0], [1])]) == [2]  # token 1 was output: it costs 1
    with pytest.raises(ValueError, match="token history"):
        sample(logits, [penalized])


def test_min_tokens_holds_back_end_of_sequence_and_stop_tokens():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]])  # 2 (eos) then 3 (a stop token) are the most likely
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,), all_stop_token_ids=(2, 3))
    assert sample(logits, [p], histories=[([5], [])]) == [1]
    assert sample(logits, [p], histories=[([5], [1])]) == [1]
    assert sample(logits, [p], histories=[([5], [1, 1])]) == [2]  # min_tokens reached
    assert not SamplingParams(min_tokens=2).penalized  # nothing to hold back: no history needed


def test_min_p_drops_tokens_below_its_share_of_the_most_likely():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.clamp_min(1e-9).log()[None].repeat(400, 1)
    p = SamplingParams(temperature=1.0, min_p=0.5)  # keeps p >= 0.25: tokens 0 and 1
    torch.manual_seed(0)
    got = sample(logits, [p] * 400)
    assert set(got) == {0, 1} and 0.5 < got.count(0) / 400 < 0.75  # renormalized: 0.5 / 0.8 = 0.625
