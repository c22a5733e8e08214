"""ModelConfig from Hugging Face config dicts: sliding-window keys, RoPE variants, tp checks, bad input."""

import json

import pytest

from workers.config import ModelConfig

BASE = dict(model_type="qwen3", vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_llama_defaults():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "llama", "head_dim": None, "rope_theta": 500000.0,
                               "eos_token_id": [1, 2], "bos_token_id": 0})
    assert cfg.head_dim == 16 and cfg.rope_theta == 500000.0 and not cfg.qk_norm
    assert cfg.eos_token_ids == (1, 2) and cfg.bos_token_id == 0
    assert [cfg.window_of_layer(i) for i in range(4)] == [None] * 4


def test_layer_types_with_sliding_window():
    cfg = ModelConfig.from_hf({**BASE, "use_sliding_window": True, "sliding_window": 8,
                               "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert cfg.qk_norm
    assert [cfg.window_of_layer(i) for i in range(4)] == [8, None, 8, None]


def test_use_sliding_window_false_turns_windows_off_like_transformers():
    cfg = ModelConfig.from_hf({**BASE, "use_sliding_window": False, "sliding_window": 8,
                               "layer_types": ["sliding_attention"] * 4})
    assert cfg.layer_windows == (None,) * 4


def test_max_window_layers_without_layer_types():
    cfg = ModelConfig.from_hf({**BASE, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2})
    assert cfg.layer_windows == (None, None, 8, 8)


def test_mistral_window_applies_to_every_layer():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 32})
    assert cfg.layer_windows == (32,) * 4


def test_rope_parameters_new_and_old_format():
    new = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}})
    old = ModelConfig.from_hf({**BASE, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert new.rope_scaling == old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    llama3 = ModelConfig.from_hf({**BASE, "max_position_embeddings": 128, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    assert llama3.rope_scaling["original_max_position_embeddings"] == 128


def test_qwen2_has_qkv_bias_only():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "qwen2"})
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm


@pytest.mark.parametrize("patch, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries for 4 layers"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer type 'chunked_attention' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type 'yarn'"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"hidden_act": "swish2"}, "hidden_act 'swish2'"),
    ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window must be positive"),
])
def test_bad_configs_are_rejected_clearly(patch, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**BASE, **patch})


def test_missing_key_is_named():
    d = dict(BASE)
    del d["hidden_size"]
    with pytest.raises(ValueError, match="'hidden_size'"):
        ModelConfig.from_hf(d)


def test_tp_divisibility():
    cfg = ModelConfig.from_hf(BASE)
    cfg.check_tp(2)
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\) is not divisible by tp_size \(4\)"):
        cfg.check_tp(4)
    with pytest.raises(IndexError):
        cfg.window_of_layer(4)


def test_from_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_dir(tmp_path).num_layers == 4
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_dir(tmp_path / "missing")
