"""Stop conditions and the text each request has produced so far.

Stops on: EOS (unless ``ignore_eos``), a stop token id, ``max_tokens``, the context length, or
a stop string. A stop string is removed from the text, and text that might be the start of a
stop string is held back until it is known not to be one, so a client never sees part of it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.engine.output_text import OutputText
from pdserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class StopChecker:
    def __init__(self, model_dir: str | Path | None, eos_token_ids: tuple[int, ...], max_model_len: int,
                 emit_text: bool = True) -> None:
        self.tokenizer = load_tokenizer(model_dir) if model_dir is not None else None
        self._emit_text = emit_text
        self._eos = frozenset(eos_token_ids)
        self._max_model_len = max_model_len
        self._text: dict[str, OutputText] = {}

    def start(self, seq: Sequence) -> None:
        """Track the request's text when it is wanted or its stop strings need it."""
        if self.tokenizer is not None and (self._emit_text or seq.params.stop):
            p = seq.params
            self._text[seq.request_id] = OutputText(self.tokenizer, seq.prompt_token_ids, p.stop,
                                                    skip_special_tokens=p.skip_special_tokens,
                                                    include_stop_str=p.include_stop_str_in_output,
                                                    spaces_between_special_tokens=p.spaces_between_special_tokens)

    def discard(self, request_id: str) -> None:
        self._text.pop(request_id, None)

    def push(self, seq: Sequence, token_id: int) -> str:
        """Record the text of a newly sampled token; return the text that may be shown now."""
        st = self._text.get(seq.request_id)
        if st is None:
            return ""
        if token_id in self._eos and not seq.params.ignore_eos:
            return ""  # EOS carries no text
        delta = st.push(token_id)
        seq.output_text = st.text
        return delta

    def check(self, seq: Sequence) -> FinishReason | None:
        """The reason ``seq`` must stop now, or None."""
        last = seq.output_token_ids[-1]
        early = len(seq.output_token_ids) < seq.params.min_tokens   # EOS and stop ids may not end it yet
        if not seq.params.ignore_eos and last in self._eos and not early:
            return FinishReason.STOP
        if last in seq.params.stop_token_ids and not early:
            return FinishReason.STOP
        st = self._text.get(seq.request_id)
        if st is not None and st.stopped:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self._max_model_len:
            return FinishReason.LENGTH
        return None

    def flush(self, seq: Sequence) -> str:
        """At finish: emit held-back text (unless a stop string ended it) and drop the state."""
        st = self._text.pop(seq.request_id, None)
        if st is None:
            return ""
        if st.stopped or seq.finish_reason is FinishReason.PREFILLED:
            return ""
        delta = st.finish()
        seq.output_text = st.text
        return delta
