"""The engine's request rules and errors, without torch or Ray, so the HTTP layer maps them to status codes
and test fakes apply the very rules the engine applies."""

from __future__ import annotations


class RequestError(ValueError):
    """Bad input for the engine (an HTTP 400): the message says what is wrong, `code` is machine-readable."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class EngineError(RuntimeError):
    """The engine cannot serve now (an HTTP 503): no dp group is up, or it is shutting down. `retry_after_s`
    is when a client may try again (the Retry-After header)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # keep retry_after_s across Ray (the engine replica -> the ingress)
        return type(self), (str(self), self.retry_after_s)


class EngineStopping(EngineError):
    """The engine replica is stopping (Serve scales it down, or the app is redeployed or deleted) with this
    request admitted: the ingress sends it again, as prompt + tokens so far, to a replica that stays
    (deployment/ingress/resend.py), as it does when a replica dies."""


# Retry-After of a request refused because no dp group is up (a group restarts in seconds on CPU)
RETRY_AFTER_DOWN_S = 5.0


class Overloaded(EngineError):
    """The engine's waiting queue is full (an HTTP 429): nothing else is affected."""


class RequestFailed(RuntimeError):
    """One request failed on its ranks (an HTTP 500); the engine and every other request go on."""


def one_line(error: BaseException) -> str:
    """`Type: message` of an error's first line, without a Ray traceback (a RayTaskError names its cause)."""
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


def check_request(prompt_token_ids: list[int], max_tokens: int, vocab_size: int, max_model_len: int,
                  max_seq_len: int) -> None:
    """Raise RequestError for a request that must never reach a rank: the one place these rules live."""
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError("the prompt is empty", "empty_prompt")
    if vocab_size and (max(prompt_token_ids) >= vocab_size or min(prompt_token_ids) < 0):
        bad = max(prompt_token_ids) if max(prompt_token_ids) >= vocab_size else min(prompt_token_ids)
        raise RequestError(f"prompt token ids must be in [0, {vocab_size}), got {bad}", "invalid_token_id")
    if n + max_tokens > max_model_len:
        why = "" if max_model_len == max_seq_len else " (the most one rank's KV cache holds)"
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens{why}. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion).",
            "context_length_exceeded")
