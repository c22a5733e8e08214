"""What a `model` setting names, and its config checked without loading weights: no torch, so the app's
builder checks the model before anything is deployed (a bad file or tp fails `serve run` at once).

`resolve_model` is the one table of what `KVFLEET_MODEL` may say: "random" (or "") is the built-in model,
"simulated" the simulated ranks' (workers/simulated.py: its shape from a cost profile, the byte tokenizer), a
name in `gguf_model.PACKAGED_MODELS` (the default, "smollm2-135m-instruct") is a GGUF file a pip package
ships, a path ending in `.gguf` is a GGUF file (`workers/gguf_model.py`), any other path a Hugging Face
directory.
"""

from __future__ import annotations

from pathlib import Path

from workers.config import ModelConfig
from workers.cost_model import DEFAULT_PROFILE, CostProfile, load_profile
from workers.gguf_model import PACKAGED_MODELS, check_gguf, packaged_gguf
from workers.tokenizer import ByteTokenizer, HFTokenizer

RANDOM_MODEL = "random"
SIMULATED_MODEL = "simulated"
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model(model: str | None) -> tuple[str, str | None]:
    """`(kind, path)` of a model setting: ("random", None), ("simulated", None), ("gguf", file) or ("hf", directory).

    Raises ValueError (a GGUFError for GGUF files) when the name is unknown or the path does not exist."""
    if not model or model == RANDOM_MODEL:
        return RANDOM_MODEL, None
    if model == SIMULATED_MODEL:
        return SIMULATED_MODEL, None
    if model in PACKAGED_MODELS:
        return "gguf", str(packaged_gguf(model))
    p = Path(model)
    if p.suffix == ".gguf":
        return "gguf", model
    if p.is_dir():
        return "hf", model
    names = ", ".join([RANDOM_MODEL, SIMULATED_MODEL, *PACKAGED_MODELS])
    raise ValueError(f"model {model!r} is neither a known name ({names}), a .gguf file nor a model directory")


def check_model(model: str | None, tp_size: int = 1, profile: str = DEFAULT_PROFILE) -> ModelConfig:
    """The model's config, checked without loading weights (GGUF: header, architecture, tensor types) and
    against `tp_size`: what the engine calls before it creates any rank. `profile` is read for `simulated`."""
    kind, path = resolve_model(model)
    if kind == RANDOM_MODEL:
        cfg = default_config()
    elif kind == SIMULATED_MODEL:
        cfg = simulated_config(load_profile(profile))
    elif kind == "gguf":
        cfg = check_gguf(path)
    else:
        cfg = ModelConfig.from_dir(path)
    try:
        cfg.check_tp(tp_size)
    except ValueError as exc:
        raise ValueError(f"model {model!r}: {exc}") from None
    return cfg


def default_config() -> ModelConfig:
    """The built-in model: 4 layers, hidden 128, 4 q / 2 KV heads of 32, layer 1 slides over 64 tokens."""
    tok = ByteTokenizer()
    return ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        model_type="qwen3",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        qk_norm=True,
        layer_windows=(None, 64, None, None),
        bos_token_id=tok.bos_token_id,
        eos_token_ids=(tok.eos_token_id,),
    )


def simulated_config(profile: CostProfile) -> ModelConfig:
    """The simulated model's shape: the profile's layers and KV heads (the KV cache's layout), the byte
    tokenizer's vocabulary."""
    tok = ByteTokenizer()
    width = profile.num_kv_heads * profile.head_dim
    return ModelConfig(
        vocab_size=tok.vocab_size, hidden_size=width, intermediate_size=width, num_layers=profile.num_layers,
        num_heads=profile.num_kv_heads, num_kv_heads=profile.num_kv_heads, head_dim=profile.head_dim,
        model_type="llama", max_position_embeddings=profile.max_position_embeddings,
        layer_windows=profile.layer_windows, bos_token_id=tok.bos_token_id, eos_token_ids=(tok.eos_token_id,))


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """The model's tokenizer: the byte tokenizer for the built-in model, a GGUF file's own (after checking
    the file, so a bad one fails here, before any rank exists), or a directory's tokenizer.json."""
    kind, file = resolve_model(path)
    if kind in (RANDOM_MODEL, SIMULATED_MODEL):
        return ByteTokenizer()
    if kind == "gguf":
        from workers.gguf_tokenizer import gguf_tokenizer

        check_gguf(file)
        return gguf_tokenizer(file)
    return HFTokenizer.from_dir(file)
