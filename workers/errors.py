"""The engine's errors, in a module without torch or Ray so the HTTP layer can map them to status codes."""

from __future__ import annotations


class RequestError(ValueError):
    """Bad input for the engine (an HTTP 400): the message says what is wrong, `code` is machine-readable."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class EngineError(RuntimeError):
    """The engine cannot serve (a rank died, or it is shutting down)."""


class RequestFailed(RuntimeError):
    """One request failed on its ranks (an HTTP 500); the engine and every other request go on."""


def one_line(error: BaseException) -> str:
    """`Type: message` of an error's first line, without a Ray traceback (a RayTaskError names its cause)."""
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")
