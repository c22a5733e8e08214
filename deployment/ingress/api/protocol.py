"""OpenAI-compatible request models and response builders for /v1/completions and /v1/chat/completions.

Requests are strict: a misspelt or unsupported field (`extra="forbid"`), or a value of the wrong JSON type
(`strict`: `"3"` or `true` for a number, `"yes"` for a boolean; an integer is a number), is a 400 that names
it, never silently ignored or coerced. vLLM's sampling extensions (repetition_penalty, top_k, min_p,
min_tokens, stop_token_ids, ignore_eos) are implemented as vLLM's server does them, and so are OpenAI's
presence and frequency penalties. Options kvfleet cannot honour (n > 1, logprobs, echo, beam search, ...) are
accepted only at their no-op value, so ordinary clients that send defaults still work. Nothing in a request
names a file or a model to load: `model` must equal the served name.
"""

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_STOP_STRINGS = 4
# every distinct salt costs each rank a reuse-tree root keyed by the salt while its blocks are cached, so a
# salt is bounded: 256 characters hold any tenant id or random secret (vLLM suggests 43 base64 characters,
# 256 bits) with room to spare. vLLM itself sets no limit
MAX_CACHE_SALT_CHARS = 256


def _check_unicode(value: Any) -> None:
    """Raise for a string (or key) that is not valid Unicode: a lone UTF-16 surrogate, which JSON's \\u escapes
    can carry but no tokenizer can encode and no response can quote."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode (it holds a lone surrogate code point)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k)
            _check_unicode(v)
    elif isinstance(value, list | tuple):
        for v in value:
            _check_unicode(v)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="with include_usage, every chunk carries the usage "
                                         "so far (an extension, as in vLLM)")
    resumable: bool = Field(False, description="an extension (as vLLM's continuous_usage_stats): every chunk "
                            "carries an SSE id, and a cut stream resumes with Last-Event-ID (docs/http-api.md)")


class ResponseFormat(_Strict):
    type: Literal["text"] = Field(description="only plain text (json_object / json_schema are not supported)")


def _refuse_if_set(cls: type, v: Any, info: ValidationInfo) -> Any:
    """The validator of OpenAI fields kvfleet does not implement: refused when set (unset or empty is fine)."""
    if v:
        raise ValueError(f"{info.field_name} is not supported")
    return v


class SamplingRequest(_Strict):
    model: str | None = Field(None, description="must be the served model name; omitted = the served model")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate; omitted = the server default")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off (extension, as in vLLM)")
    seed: int | None = Field(None, ge=0, lt=2**63)
    ignore_eos: bool = Field(False, description="generate past the end-of-sequence token (extension, as in vLLM)")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extensions, as its server takes them (`vllm bench serve` sends repetition_penalty)
    repetition_penalty: float = Field(1.0, gt=0, description="> 1 discourages tokens of the prompt and the "
                                      "output (extension, as in vLLM)")
    min_p: float = Field(0.0, ge=0, le=1, description="drop tokens less likely than this times the most likely "
                         "(extension, as in vLLM)")
    min_tokens: int = Field(0, ge=0, description="no end-of-sequence, stop token or stop string before this many "
                            "tokens (extension, as in vLLM)")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end the completion, not returned "
                                             "(extension, as in vLLM)")
    use_beam_search: bool = Field(False, description="only false (extension of vLLM's)")
    skip_special_tokens: bool = Field(True, description="only true: special tokens are never returned as text "
                                      "(extension of vLLM's)")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS,
                                   description="vLLM's prefix-cache salt: requests reuse cached blocks only of "
                                   "requests with the same salt (a tenant's isolation); 1 to "
                                   f"{MAX_CACHE_SALT_CHARS} characters")
    # accepted and ignored, as vLLM's server does: they change nothing kvfleet generates
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    _unsupported = field_validator("logit_bias", "use_beam_search")(_refuse_if_set)

    @field_validator("skip_special_tokens")
    @classmethod
    def _skip_special_tokens(cls, v: bool) -> bool:
        if not v:
            raise ValueError("only skip_special_tokens=true is supported")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and min(v) < 0:
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def resumable(self) -> bool:
        return bool(self.stream_options and self.stream_options.resumable)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] = Field(description="text, or token ids")
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        # OpenAI also takes a batch (list of strings / of token lists); kvfleet serves one prompt per request.
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]
        if isinstance(v, str | list) and not v:  # refused before tokenizing: a BOS would make "" one token
            raise PydanticCustomError("empty_prompt", "the prompt is empty")  # the engine's code for it
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise ValueError("prompt must be a string or a list of token ids (batches are not supported)")
            if min(v) < 0:
                raise ValueError("token ids must be >= 0")
            return v
        raise ValueError("prompt must be a string or a list of token ids")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v

    _refused = field_validator("echo", "logprobs", "suffix")(_refuse_if_set)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    parallel_tool_calls: bool | None = None  # no tools are offered, so it changes nothing
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    _refused = field_validator("logprobs", "top_logprobs")(_refuse_if_set)

    @model_validator(mode="after")
    def _one_token_limit(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree")
            self.max_tokens = self.max_completion_tokens
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---- responses (plain dicts in OpenAI's shapes) ----

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(id_: str, model: str, text: str, finish_reason: str | None, use: dict,
                        created: int) -> dict:
    return {"id": id_, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def completion_chunk(id_: str, model: str, created: int, text: str, finish_reason: str | None) -> dict:
    return {"id": id_, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_response(id_: str, model: str, text: str, finish_reason: str | None, use: dict,
                  created: int) -> dict:
    return {"id": id_, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def chat_chunk(id_: str, model: str, created: int, delta: dict, finish_reason: str | None) -> dict:
    return {"id": id_, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(id_: str, model: str, created: int, obj: str, use: dict) -> dict:
    return {"id": id_, "object": obj, "created": created, "model": model, "choices": [], "usage": use}
