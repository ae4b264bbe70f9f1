"""OpenAI-compatible response bodies for completions and chat completions (plain and streamed).

Besides the OpenAI fields, every body carries a ``pdserve`` object: the request id, the token
ids of this body (or chunk), and on the last one the request's phase record. ``usage`` always
includes ``prompt_tokens_details.cached_tokens`` (0 when nothing was cached).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.router.backend import Finished
from pdserve.router.serving import Chunk
from pdserve.router.tools import ToolRequest, ToolStream, parse_reply

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def usage_body(final: Finished) -> dict:
    """OpenAI's usage from the phase record (``Serving`` counts the tokens the client was sent)."""
    ph = final.phase
    return usage_totals(ph.prompt_tokens, ph.cached_prompt_tokens, ph.output_tokens)


def usage_totals(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseBuilder:
    """Shapes one request's chunks into OpenAI JSON; ``chat`` picks the chat format."""

    def __init__(self, request_id: str, model: str, tokenizer: PreTrainedTokenizerBase, *, chat: bool,
                 logprobs: int | None, index: int = 0, tools: ToolRequest | None = None,
                 tokens_as_ids: bool = False, prompt_ids: list[int] | None = None,
                 prompt_logprobs: int | None = None, echo: str = "", score_only: bool = False,
                 return_token_ids: bool = False) -> None:
        """``prompt_logprobs``: how many alternatives the client asked for at each prompt token (vLLM's
        field; None: not asked). ``echo``: the prompt's text, which leads the completion's text (and,
        with ``logprobs``, its tokens lead the logprobs). ``score_only``: OpenAI's ``max_tokens`` 0
        with ``echo``: the one token generated is left out."""
        self._prompt_ids = prompt_ids or []
        self._prompt_lp = prompt_logprobs
        self._echo = echo
        self._score_only = score_only
        self._return_ids = return_token_ids  # vLLM's return_token_ids: the ids beside the text
        self._prompt_ids_sent = False
        self._tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: "token_id:<id>"
        self.request_id = request_id
        self.index = index  # the choice this builder shapes (n > 1, several prompts)
        # Chat with tools the model may call: the reply's calls become tool_calls (router/tools.py).
        self.tools = tools if chat and tools is not None and tools.choice != "none" else None
        self._tool_stream = ToolStream(self.tools) if self.tools is not None else None
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._tok = tokenizer
        self._logprobs = logprobs
        self._text_offset = 0

    def _envelope(self, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _token_str(self, token_id: int) -> str:
        if self._tokens_as_ids:
            return f"token_id:{token_id}"
        return self._tok.decode([token_id], skip_special_tokens=False)

    def logprobs_body(self, chunks: list[Chunk]) -> dict | None:
        if self._logprobs is None:
            return None
        pairs = [(t, lp) for c in chunks if c.logprobs for t, lp in zip(c.token_ids, c.logprobs)]
        if self.chat:
            content = []
            for tok, lp in pairs:
                s = self._token_str(tok)
                top = sorted(lp.items(), key=lambda kv: -kv[1])[: self._logprobs]
                content.append({
                    "token": s, "logprob": lp.get(tok), "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [{"token": self._token_str(t), "logprob": v,
                                      "bytes": list(self._token_str(t).encode("utf-8"))} for t, v in top],
                })
            return {"content": content}
        body: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, lp in pairs:
            s = self._token_str(tok)
            body["tokens"].append(s)
            body["token_logprobs"].append(lp.get(tok))
            top = sorted(lp.items(), key=lambda kv: -kv[1])[: self._logprobs]
            body["top_logprobs"].append({self._token_str(t): v for t, v in top})
            body["text_offset"].append(self._text_offset)
            self._text_offset += len(s)
        return body

    def _prompt_logprobs_list(self, scored) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each one a map from
        token id to its logprob, rank and text: the prompt's token and the top alternatives."""
        k = self._prompt_lp or 0
        out: list[dict | None] = [None]
        for i, (entry, rank) in enumerate(zip(scored.entries, scored.ranks)):
            tok = self._prompt_ids[i + 1]
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            item = {str(t): {"logprob": v, "rank": r, "decoded_token": self._token_str(t)}
                    for r, (t, v) in enumerate(top, start=1)}
            item[str(tok)] = {"logprob": entry[tok], "rank": rank, "decoded_token": self._token_str(tok)}
            out.append(item)
        return out

    def _echo_logprobs(self, scored, generated: dict | None) -> dict:
        """Legacy completions' logprobs with ``echo``: the prompt's tokens first (the first one
        without a logprob), then the generated ones, offsets counted from the start of the prompt."""
        k = self._logprobs or 0
        body: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for i, tok in enumerate(self._prompt_ids):
            s = self._token_str(tok)
            entry = scored.entries[i - 1] if i else None
            body["tokens"].append(s)
            body["token_logprobs"].append(entry[tok] if entry else None)
            body["top_logprobs"].append({self._token_str(t): v for t, v in sorted(entry.items(), key=lambda kv: -kv[1])[:k]}
                                        if entry else None)
            body["text_offset"].append(offset)
            offset += len(s)
        if generated is not None:
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                body[key] += generated[key]
            body["text_offset"] += [offset + o for o in generated["text_offset"]]
        return body

    def full(self, chunks: list[Chunk], final: Finished) -> dict:
        """The body of a non-streaming response."""
        scored = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
        if self._score_only:
            chunks = [Chunk([], "")]
        text = "".join(c.text for c in chunks)
        logprobs = self.logprobs_body(chunks)
        if self._echo:
            text = self._echo + text
            if self._logprobs is not None and scored is not None:
                logprobs = self._echo_logprobs(scored, None if self._score_only else logprobs)
        choice: dict = {"index": self.index, "logprobs": logprobs, "finish_reason": final.finish_reason}
        if self.tools is not None:
            reply = parse_reply(text, self.tools)
            choice["message"] = {"role": "assistant", "content": reply.content}
            if reply.tool_calls:
                choice["message"]["tool_calls"] = reply.tool_calls
                choice["finish_reason"] = "tool_calls"
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self._prompt_lp is not None and scored is not None and not self.chat:
            choice["prompt_logprobs"] = self._prompt_logprobs_list(scored)
        if self._return_ids:
            choice["token_ids"] = [t for c in chunks for t in c.token_ids]
            if not self.chat:
                choice["prompt_token_ids"] = list(self._prompt_ids)
        body = self._envelope(stream=False)
        body.update(choices=[choice], usage=usage_body(final))
        if self._return_ids and self.chat:
            body["prompt_token_ids"] = list(self._prompt_ids)
        if self._prompt_lp is not None and scored is not None and self.chat:
            body["prompt_logprobs"] = self._prompt_logprobs_list(scored)  # vLLM's place for it in chat
        body["pdserve"] = {"request_id": self.request_id, "token_ids": [t for c in chunks for t in c.token_ids],
                           "phase": final.phase.to_dict()}
        return body

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role; completions have no opening chunk."""
        if not self.chat:
            return None
        body = self._envelope(stream=True)
        body["choices"] = [{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}]
        if self._return_ids:
            body["prompt_token_ids"] = list(self._prompt_ids)
            self._prompt_ids_sent = True
        return body

    def echo_chunk(self) -> dict | None:
        """A stream's chunk of the echoed text (before any generated text), if ``echo`` is set."""
        return self.chunk(Chunk([], self._echo)) if self._echo else None

    def chunk(self, chunk: Chunk) -> dict:
        choice: dict = {"index": self.index, "logprobs": self.logprobs_body([chunk]), "finish_reason": None}
        if self._tool_stream is not None:
            choice["delta"] = {"content": self._tool_stream.push(chunk.text)}
        elif self.chat:
            choice["delta"] = {"content": chunk.text}
        else:
            choice["text"] = chunk.text
        if self._return_ids:
            choice["token_ids"] = list(chunk.token_ids)
            if not self._prompt_ids_sent:
                choice["prompt_token_ids"] = list(self._prompt_ids)
                self._prompt_ids_sent = True
        body = self._envelope(stream=True)
        body["choices"] = [choice]
        body["pdserve"] = {"token_ids": chunk.token_ids}
        return body

    def closing_chunks(self, final: Finished) -> list[dict]:
        """The chunks that end a streamed choice: with tools, the content held back and the calls
        (one delta each, arguments whole), then ``final_chunk``."""
        out = []
        reason = final.finish_reason
        if self._tool_stream is not None:
            rest = self._tool_stream.finish()
            deltas: list[dict] = []
            if rest.content:
                deltas.append({"content": rest.content})
            for i, call in enumerate(rest.tool_calls):
                deltas.append({"tool_calls": [{"index": i, **call}]})
            if rest.tool_calls:
                reason = "tool_calls"
            for delta in deltas:
                body = self._envelope(stream=True)
                body["choices"] = [{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}]
                body["pdserve"] = {"token_ids": []}
                out.append(body)
        out.append(self.final_chunk(final, reason))
        return out

    def final_chunk(self, final: Finished, reason: str | None = None) -> dict:
        choice: dict = {"index": self.index, "logprobs": None, "finish_reason": reason or final.finish_reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        body = self._envelope(stream=True)
        body["choices"] = [choice]
        body["pdserve"] = {"request_id": self.request_id, "token_ids": [], "phase": final.phase.to_dict()}
        return body

    def usage_chunk(self, final: Finished) -> dict:
        body = self._envelope(stream=True)
        body.update(choices=[], usage=usage_body(final))
        return body
