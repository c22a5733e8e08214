"""The simulated model and its cost model: each term of a step's time, the tokens (the same wherever and
however a sequence runs), and a simulated rank's KV cache records equal to a real model's rank when the
model plays no role (the test supplies every token)."""

import json

import numpy as np
import pytest

from deployment.settings import Settings
from tests.support.engine_harness import make_rank
from workers.cost_model import H100_LLAMA_8B, CostProfile, load_profile
from workers.model import SeqInput
from workers.model_setting import check_model, simulated_config
from workers.sampling_params import SamplingParams
from workers.simulated import SimulatedModel, next_token
from workers.step import NewRequest, StepPlan, Work

TERMS = dict(step_s=1e-3, weights_s=5e-3, token_s=1e-5, attn_pair_s=1e-9, kv_token_s=1e-7, kv_tokens=1000)


def profile(**changes) -> CostProfile:
    return CostProfile(name="test", **{**TERMS, **changes})


# ---- the cost model, term by term --------------------------------------------------------------------------

def test_an_empty_step_costs_nothing():
    assert profile().step_time([]) == 0.0


def test_a_small_decode_batch_pays_the_fixed_cost_the_weights_and_its_context():
    p = profile()
    # 4 x 1 new token: 4e-5 s of compute, under the 5 ms the weights take to read
    expect = 1e-3 + 5e-3 + sum(max(c + 1, 0) * 1e-7 for c in (10, 20, 30, 40))
    assert p.step_time([(1, 10), (1, 20), (1, 30), (1, 40)]) == pytest.approx(expect)


def test_enough_new_tokens_make_the_linear_layers_compute_bound():
    p = profile(attn_pair_s=0.0, kv_token_s=0.0)
    assert p.step_time([(1000, 0)]) == pytest.approx(1e-3 + 1000 * 1e-5)  # 10 ms > 5 ms of weights
    assert p.step_time([(100, 0)]) == pytest.approx(1e-3 + 5e-3)


def test_prefill_attention_counts_causal_pairs_over_the_cached_context():
    p = profile(step_s=0.0, weights_s=0.0, token_s=0.0, kv_token_s=0.0)
    n, start = 100, 300
    assert p.step_time([(n, start)]) == pytest.approx((n * start + n * (n + 1) // 2) * 1e-9)


def test_decode_attention_reads_the_whole_context():
    p = profile(step_s=0.0, weights_s=0.0, token_s=0.0, attn_pair_s=0.0)
    assert p.step_time([(1, 999), (1, 499)]) == pytest.approx((1000 + 500) * 1e-7)


def test_the_default_profile_is_an_h100_serving_an_8b_llama():
    p = load_profile("h100-llama3.1-8b")
    assert p is H100_LLAMA_8B
    one = p.step_time([(1, 1000)])
    assert 0.005 < one < 0.010  # one decode stream: 100-200 tokens/s, as published for this pair
    assert 300_000 < p.kv_tokens < 500_000


def test_a_profile_from_a_file(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(profile(layer_windows=[None, 64]).to_json())
    got = load_profile(str(f))
    assert got == profile(layer_windows=(None, 64))


@pytest.mark.parametrize("bad", ["no-such-gpu", "profile.txt"])
def test_an_unknown_profile_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="neither a known name"):
        load_profile(bad)


def test_a_file_with_a_bad_term_is_a_clear_error(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({**TERMS, "name": "bad", "token_s": -1}))
    with pytest.raises(ValueError, match="token_s must be a number >= 0"):
        load_profile(str(f))
    f.write_text(json.dumps({**TERMS, "name": "bad", "flops": 1}))
    with pytest.raises(ValueError, match="unexpected keyword"):
        load_profile(str(f))


# ---- the model ---------------------------------------------------------------------------------------------

def model(speedup_ratio: float = 1.0) -> SimulatedModel:
    cfg = check_model("simulated", 1, "h100-llama3.1-8b")
    return SimulatedModel(H100_LLAMA_8B, cfg, speedup_ratio)


class FakeCache:
    def __init__(self, history: int) -> None:
        self.history_length = history


def seq(tokens, start=0, all_logits=False):
    return SeqInput(list(tokens), start, FakeCache(start), all_logits)


def test_the_model_sleeps_the_profiles_time_scaled_by_the_speedup(monkeypatch):
    slept = []
    monkeypatch.setattr("workers.simulated.time.sleep", slept.append)
    m = model(speedup_ratio=0.25)
    batch = [seq(range(10, 60)), seq([7], start=300)]
    m(batch)
    expect = H100_LLAMA_8B.step_time([(50, 0), (1, 300)])
    assert slept == [pytest.approx(expect / 0.25)]
    assert m.busy_s == pytest.approx(expect)


def test_tokens_depend_on_the_sequence_only_and_are_never_special(monkeypatch):
    monkeypatch.setattr("workers.simulated.time.sleep", lambda s: None)
    m = model()
    alone = m([seq([65, 66, 67], start=5)])[0].argmax().item()
    batched = m([seq(range(70, 90)), seq([65, 66, 67], start=5), seq([1], start=40)])[1].argmax().item()
    assert alone == batched == next_token(67, 8, m.choices)
    rows = m([seq(range(3, 40), all_logits=True)])[0]
    assert rows.shape == (37, m.config.vocab_size)
    picked = set(rows.argmax(-1).tolist())
    assert not {m.config.bos_token_id, *m.config.eos_token_ids} & picked
    assert all(32 <= t < 127 for t in picked)  # printable characters of the byte tokenizer
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m([seq([m.config.vocab_size])])


def test_the_simulated_model_has_the_profiles_shape_and_the_byte_vocabulary():
    cfg = simulated_config(H100_LLAMA_8B)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.vocab_size == 258


# ---- a rank: the real KV cache on the meta device ----------------------------------------------------------

# the built-in random model's shape: 4 layers, 2 KV heads of 32, layer 1 slides over 64 tokens
RANDOM_SHAPE = dict(num_layers=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096,
                    layer_windows=[None, 64, None, None])


@pytest.fixture
def random_shaped(tmp_path, monkeypatch):
    monkeypatch.setattr("workers.simulated.time.sleep", lambda s: None)
    f = tmp_path / "random-shaped.json"
    f.write_text(profile(**RANDOM_SHAPE).to_json())
    return str(f)


def rank(model_name: str, profile_file: str = "h100-llama3.1-8b", **cache):
    settings = dict(model=model_name, simulated_profile=profile_file, engine_id="e", dp=1, tp=1, device="cpu",
                    max_seq_len=512, tokens_per_block=16, kv_cache_bytes=320 << 10, host_cache_bytes=128 << 10,
                    max_num_batched_tokens=256)
    return make_rank(Settings(**{**settings, **cache}).engine_config(), 0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def workload():
    """Plans whose every token the test chooses: prefixes shared, requests closed and reused, a cache too
    small for all of them (eviction, suspension to the host tier), decode tokens appended by the test."""
    shared = list(range(1, 40))
    prompts = {f"r{i}": shared + [100 + i] * (20 + 7 * i) for i in range(8)}
    plans, running, it = [], [], 0
    for rid, prompt in prompts.items():
        it += 1
        running.append(rid)
        work = [Work(rid, len(prompt))] + [Work(r, 1, 120 + it) for r in running[:-1]]  # the new one first
        close = [running.pop(0)] if len(running) > 3 else []
        plans.append(StepPlan(it, [NewRequest(rid, prompt, GREEDY)], work, close))
        for _ in range(2):
            it += 1
            plans.append(StepPlan(it, work=[Work(r, 1, 160 + it) for r in running]))
    return plans


def comparable(res, layout):
    """A step result without what the model decides (its tokens, time and memory)."""
    ran = {rid: hist for rid, (hist, _) in res.ran.items()}
    counters, gauges, kv_stats, sched = layout.parts(res.delta.row)
    sched = np.delete(sched, [0, 11, 12, 13])  # step_us, gpu/cpu/pinned memory
    return (ran, res.deferred, res.recomputed, res.suspended, res.reused, res.reused_host, res.first_reuse,
            res.failed, res.free_blocks, [type(e).__name__ for e in res.kv_events or []],
            counters.tolist(), gauges.tolist(), kv_stats.tolist(), sched.tolist())


def test_a_simulated_rank_keeps_the_same_kv_records_as_a_real_model(random_shaped):
    real, sim = rank("random"), rank("simulated", random_shaped)
    assert real.layout.shape == sim.layout.shape
    assert sim.kv._primary[0].tensor.device.type == "meta"
    suspended = recomputed = 0
    for plan in workload():
        plan.kv_events = True
        a, b = real.step(plan), sim.step(plan)
        assert comparable(a, real.layout) == comparable(b, sim.layout), plan.iteration
        assert not a.failed
        suspended += len(a.suspended)
        recomputed += len(a.recomputed)
    assert suspended and recomputed  # the workload reaches both kinds of preemption, not just the happy path
    assert real.kv.get_kv_cache_stats() == sim.kv.get_kv_cache_stats()


def test_a_sequence_continues_the_same_after_a_resend(monkeypatch):
    monkeypatch.setattr("workers.simulated.time.sleep", lambda s: None)
    prompt = list(range(40, 90))

    def generate(worker, rid, tokens, n, num_output_tokens=0, others=()):
        out = []
        new = [NewRequest(rid, tokens, GREEDY, num_output_tokens=num_output_tokens)]
        new += [NewRequest(o, list(range(5, 30)), GREEDY) for o in others]
        res = worker.step(StepPlan(1, new, [Work(rid, len(tokens))] + [Work(o, 25) for o in others]))
        out.append(res.ran[rid][1])
        for it in range(2, n + 1):
            res = worker.step(StepPlan(it, work=[Work(rid, 1, out[-1])]))
            out.append(res.ran[rid][1])
        return out

    def replica():  # the default profile: its KV cache of ~400k tokens, on the meta device
        return rank("simulated", kv_cache_bytes=0, host_cache_bytes=0)

    first = replica()
    assert first.kv.get_kv_cache_stats().max_num_blocks * 16 >= H100_LLAMA_8B.kv_tokens - 16
    whole = generate(first, "a", prompt, 12)
    assert generate(replica(), "b", prompt, 12, others=("x", "y")) == whole  # another replica, in a batch
    assert generate(replica(), "c", prompt + whole[:5], 7, num_output_tokens=5) == whole[5:]  # re-sent after 5

