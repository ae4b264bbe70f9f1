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
                 tokens_as_ids: bool = False) -> None:
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

    def full(self, chunks: list[Chunk], final: Finished) -> dict:
        """The body of a non-streaming response."""
        text = "".join(c.text for c in chunks)
        choice: dict = {"index": self.index, "logprobs": self.logprobs_body(chunks), "finish_reason": final.finish_reason}
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
        body = self._envelope(stream=False)
        body.update(choices=[choice], usage=usage_body(final))
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
        return body

    def chunk(self, chunk: Chunk) -> dict:
        choice: dict = {"index": self.index, "logprobs": self.logprobs_body([chunk]), "finish_reason": None}
        if self._tool_stream is not None:
            choice["delta"] = {"content": self._tool_stream.push(chunk.text)}
        elif self.chat:
            choice["delta"] = {"content": chunk.text}
        else:
            choice["text"] = chunk.text
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
