"""A request's output text: incremental, UTF-8 safe, with stop strings. The one implementation:
the router builds each stream's text with it, and the engine's ``StopChecker`` its stop strings.

Token ids become text through the engine's ``IncrementalDetokenizer`` (``tokenizers``'
``DecodeStream``, which waits while the text ends in half a UTF-8 character). On top of it this class:

* finds stop strings in the text, including one that spans several tokens;
* truncates the text where the first stop string begins (the stop string is not shown), or
  where it ends with ``include_stop_str`` (vLLM's ``include_stop_str_in_output``);
* holds back a tail of text that could still become a stop string, so a streaming client never
  sees part of one; the held text is released when it cannot be one or at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputText:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
        spaces_between_special_tokens: bool = False,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens,
                                             spaces_between_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str
        self._longest = max((len(s) for s in self._stop), default=0)
        self._emitted = 0            # characters of the decoded text already returned
        self._stopped_at: int | None = None
        self._finished = False

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; later tokens are ignored."""
        return self._stopped_at is not None

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._detok.text[: self._emitted]

    def push(self, token_id: int) -> str:
        """Add one token; return the text that may be shown now (possibly empty)."""
        if self._finished or self.stopped:
            return ""
        before = len(self._detok.text)
        self._detok.push([token_id])
        full = self._detok.text
        if self._stop and len(full) > before:
            start = max(0, before - self._longest + 1)
            hits = [(i, len(s)) for i, s in ((full.find(s, start), s) for s in self._stop) if i >= 0]
            if hits:
                at, length = min(hits)
                self._stopped_at = at + length if self._include_stop else at
                return self._release(self._stopped_at)
        return self._release(len(full) - self._held_back(full))

    def finish(self) -> str:
        """The stream ended: return the remaining text (nothing past a stop string)."""
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        self._detok.flush()
        return self._release(len(self._detok.text))

    def _release(self, limit: int) -> str:
        if limit <= self._emitted:
            return ""
        delta = self._detok.text[self._emitted : limit]
        self._emitted = limit
        return delta

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
