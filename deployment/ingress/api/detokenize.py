"""Text deltas with OpenAI stop strings, on top of the tokenizer's incremental detokenizer.

The tokenizer's detokenizer (workers/tokenizer.py) already holds back incomplete UTF-8 characters. This
adds stop strings: text is released only once it cannot be the start of a stop string, so a client never
receives text that has to be taken back, and the stop string itself is never sent (OpenAI's behaviour).
"""

from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class TextStream:
    def __init__(self, detokenizer: Detokenizer, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._detok = detokenizer
        self._stop = [s for s in stop if s]
        self._pending = ""  # decoded, not yet released (could still become a stop string)
        self._before_stops = min_tokens  # tokens whose text no stop string may end (vLLM's min_tokens)
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly final text. Sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        if self._before_stops > 0:  # stop strings apply from the min_tokens-th token's text on
            self._before_stops -= 1
            text = self._pending + self._detok.step(token_id)
            self._pending = ""
            return text
        self._pending += self._detok.step(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """The generation ended: release whatever was held back."""
        if self.stopped:
            return ""
        self._pending += self._detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._pending
        hits = [i for i in (text.find(s) for s in self._stop) if i != -1]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[: min(hits)]
        end = len(text) if final else len(text) - self._stop_prefix_len(text)
        self._pending = text[end:]
        return text[:end]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold
