"""Tokenizers: a byte-level one for the built-in model, and a model directory's `tokenizer.json`.

Both expose the same small surface (`encode`, `decode`, `eos_token_id`, `eos_token_ids`, `bos_token_id`,
`vocab_size`, `apply_chat_template`, `encode_chat`, `detokenizer()`), so the engine and the HTTP layer never
care which one they hold. Streaming uses `IncrementalDetokenizer`: it decodes a short window of recent ids
and holds text back while it ends in an incomplete character (U+FFFD), so a multi-byte UTF-8 character split
over tokens is emitted whole, once, and the concatenated deltas equal `decode(all ids)`.

Chat templates: a directory's Jinja `chat_template` (tokenizer_config.json or chat_template.jinja) is
rendered in a sandbox with `messages`, `add_generation_prompt`, `bos_token`, `eos_token`; without one, and
for the byte tokenizer, the role-tag template is used:
`<|role|>\\n{content}\\n` per message, then `<|assistant|>\\n` when a generation prompt is asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPLACEMENT = "\ufffd"


def _message_text(i: int, m: Any) -> tuple[str, str]:
    if not isinstance(m, dict):
        raise ValueError(f"message {i} must be an object with 'role' and 'content', got {type(m).__name__}")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or not role:
        raise ValueError(f"message {i}: 'role' must be a non-empty string")
    if content is None:
        content = ""
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError(f"message {i}: only text content parts are supported")
            parts.append(p["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ValueError(f"message {i}: 'content' must be a string or a list of text parts")
    return role, content


def role_tag_template(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """`<|role|>\\n{content}\\n` per message, then `<|assistant|>\\n` if `add_generation_prompt`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = [f"<|{role}|>\n{content}\n" for role, content in (_message_text(i, m) for i, m in enumerate(messages))]
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas (vLLM-style prefix/read offsets)."""

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window (context for tokenizers that strip leading spaces)
        self._read = 0  # ids before this are emitted

    def step(self, token_id: int) -> str:
        """Add one id; return the newly completed text ("" while a character is incomplete)."""
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read])
        new_text = self.tokenizer.decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Text held back at the end of the stream (an incomplete character shows as U+FFFD)."""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read])
        new_text = self.tokenizer.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]


class ByteTokenizer:
    """Bytes 0..255 are ids 0..255; 256 is BOS, 257 is EOS. `encode` prepends BOS by default."""

    BOS = 256
    EOS = 257

    vocab_size = 258
    bos_token_id: int | None = BOS
    eos_token_id: int = EOS
    eos_token_ids: tuple[int, ...] = (EOS,)
    name = "byte"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytearray()
        for i in ids:
            if 0 <= i < 256:
                data.append(i)
            elif not skip_special_tokens:
                data.extend(b"<|bos|>" if i == self.BOS else b"<|eos|>" if i == self.EOS else b"")
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return role_tag_template(messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Render the chat (with a generation prompt) and encode it: BOS + the role-tag text."""
        return self.encode(self.apply_chat_template(messages))

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class HFTokenizer:
    """A `tokenizers` tokenizer.json plus the special tokens and chat template of its model directory."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None,
        chat_template: str | None = None,
        bos_token: str = "",
        eos_token: str = "",
        name: str = "",
    ):
        if not eos_token_ids:
            raise ValueError(
                "tokenizer: no EOS token found (tokenizer_config.json, generation_config.json "
                "or config.json must name one)"
            )
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self._bos_token, self._eos_token = bos_token, eos_token
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.name = name
        self._template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer

        d = Path(path)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {str(path)!r}")
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        tcfg = _read_json(d / "tokenizer_config.json")
        gcfg = _read_json(d / "generation_config.json")
        mcfg = _read_json(d / "config.json")

        def token_id(entry: Any) -> tuple[str, int | None]:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return (text or "", tok.token_to_id(text) if text else None)

        bos_text, bos_id = token_id(tcfg.get("bos_token"))
        eos_text, eos_id = token_id(tcfg.get("eos_token"))
        eos_ids: list[int] = [] if eos_id is None else [eos_id]
        for cfg in (gcfg, mcfg):
            e = cfg.get("eos_token_id")
            for i in e if isinstance(e, list) else [] if e is None else [e]:
                if int(i) not in eos_ids:
                    eos_ids.append(int(i))
        if bos_id is None:
            b = gcfg.get("bos_token_id", mcfg.get("bos_token_id"))
            bos_id = None if b is None else int(b)
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        return cls(
            tok,
            eos_token_ids=tuple(eos_ids),
            bos_token_id=bos_id,
            chat_template=template,
            bos_token=bos_text,
            eos_token=eos_text,
            name=d.name,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        except TypeError as e:  # the Rust tokenizer's answer to text that is not valid Unicode
            raise ValueError(f"cannot tokenize the text: {e}") from None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the directory's chat template, or the role-tag template when it has none."""
        if self.chat_template is None:
            return role_tag_template(messages, add_generation_prompt)
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        msgs = [{"role": r, "content": c} for r, c in (_message_text(i, m) for i, m in enumerate(messages))]
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            if self._template is None:
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = _raise_template_error
                self._template = env.from_string(self.chat_template)
            return self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except TemplateError as e:  # a template that fails on these messages (undefined names, sandbox)
            raise ValueError(f"chat template: {type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Render the chat (with a generation prompt) and encode it without doubling a BOS that the
        template already wrote (as vLLM does: no special tokens when the text starts with the BOS token)."""
        text = self.apply_chat_template(messages)
        has_bos = bool(self._bos_token) and text.startswith(self._bos_token)
        return self.encode(text, add_special_tokens=not has_bos)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _read_json(p: Path) -> dict[str, Any]:
    if not p.is_file():
        return {}
    with p.open() as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}
