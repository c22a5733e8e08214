"""The tokenizer a GGUF file describes, as an `HFTokenizer` (so chat templates and streaming are shared).

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), the BPE merges,
each token's type (3 = control, 4 = user-defined), the pre-tokenizer's name (`tokenizer.ggml.pre`), the
special ids, whether to add BOS/EOS, and the Jinja chat template. We rebuild a `tokenizers` byte-level BPE
from those. Pre-tokenizers are known by name, as in llama.cpp; an unknown name is an error, not a guess,
because a wrong split silently changes every id. Stop ids: the file's EOS, its end-of-turn token when it
names one, and `<|im_end|>` when the vocabulary has it (ChatML ends each turn with it).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from workers.gguf_model import GGUFError, field, read_gguf
from workers.tokenizer import HFTokenizer

CONTROL, USER_DEFINED = 3, 4
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt2", "smollm")


def gguf_tokenizer(path: str | Path) -> HFTokenizer:
    """Build the tokenizer of the GGUF file at `path` (raises GGUFError naming the file when it cannot)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    path = str(path)
    reader = read_gguf(path)
    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"GGUF file {path!r}: tokenizer model {kind!r} is not supported (supported: gpt2, byte-level BPE)"
        )
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens") or []
    merges: list[str] = field(reader, "tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise GGUFError(f"GGUF file {path!r} lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types: list[int] = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)

    spell = _byte_spelling()
    alphabet = set(spell.values())
    vocab = {(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode())): i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre", "default"), path)
    tok.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == USER_DEFINED])

    def special(key: str) -> int | None:
        i = field(reader, f"tokenizer.ggml.{key}_token_id")
        return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = special("bos"), special("eos")
    if eos is None:
        raise GGUFError(f"GGUF file {path!r} names no EOS token (tokenizer.ggml.eos_token_id)")
    stops = [eos]
    for extra in (special("eot"), vocab.get("<|im_end|>")):
        if extra is not None and extra not in stops:
            stops.append(extra)
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(field(reader, "tokenizer.ggml.add_eos_token", False))
    added = [*([bos] if add_bos else []), None, *([eos] if add_eos else [])]  # None: the text
    if len(added) > 1:
        tok.post_processor = processors.TemplateProcessing(
            single=["$A" if i is None else tokens[i] for i in added],
            special_tokens=[(tokens[i], i) for i in added if i is not None],
        )
    return HFTokenizer(
        tok,
        eos_token_ids=tuple(stops),
        bos_token_id=bos,
        chat_template=field(reader, "tokenizer.chat_template"),
        bos_token=tokens[bos] if bos is not None else "",
        eos_token=tokens[eos],
        name=Path(path).stem,
    )


def _pre_tokenizer(name: str, path: str) -> Any:
    """llama.cpp's pre-tokenizer of that name: GPT-2's split, SmolLM first cutting every digit apart."""
    from tokenizers import pre_tokenizers

    if name not in SUPPORTED_PRE_TOKENIZERS:
        raise GGUFError(
            f"GGUF file {path!r}: pre-tokenizer {name!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


@functools.cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the other 68
    bytes are spelled with code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out
