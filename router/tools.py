"""Tools (function calling) on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls``.

* **The prompt.** The tools go to the model's chat template (``tools=``, as transformers passes
  them). A template that does not read ``tools`` (SmolLM2's, for one) gets them in the system
  message instead, with the format to call them in (``TOOL_PROMPT``). Earlier turns convert the
  same way: an assistant turn's ``tool_calls`` become its text in that format, a ``tool`` turn
  keeps its content.
* **The format.** A call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
  Hermes format many open models are trained on), one block per call.
* **The grammar** (``engine/structured.py``) decides what the model may write:
  ``auto``: free text, and once it opens ``<tool_call>`` a call to one of the tools whose
  arguments follow that tool's JSON schema; ``required``: a JSON array of calls (at most one
  without ``parallel_tool_calls``) and nothing else; a named function: its arguments object;
  ``none``: free text, the tools stay in the prompt.
* **The answer.** The calls are parsed out of the text into ``tool_calls`` (ids ``call_<hex>``,
  arguments as JSON text), the rest is ``content`` (None when empty), and ``finish_reason`` is
  ``tool_calls`` when there is a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.structured import StructuredOutput

MAX_TOOLS = 128
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_PROMPT = (
    "You can call these tools. To call one, write <tool_call>{{\"name\": <tool name>, \"arguments\": "
    "<the arguments as a JSON object>}}</tool_call>; write nothing else when you call a tool.\n"
    "Tools:\n{tools}")


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The request's tools (OpenAI's ``{"type": "function", "function": {...}}`` objects) and what
    the model must do with them: ``choice`` is ``auto``, ``none``, ``required`` or a tool's name."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def schema_of(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object", "properties": {}}
        raise KeyError(name)


def _bad(param: str, message: str) -> InvalidRequestError:
    from pdserve.router.errors import InvalidParameterError

    return InvalidParameterError(message, param=param)


def parse_tools(body: dict) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body, checked; None
    without tools (then ``tool_choice`` may only be ``none`` and ``parallel_tool_calls`` unset)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "'parallel_tool_calls' must be true or false")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "'tool_choice' needs 'tools'")
        if parallel is not None:
            raise _bad("parallel_tool_calls", "'parallel_tool_calls' needs 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"'tools' must be a list of at most {MAX_TOOLS} tools")
    checked = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _bad("tools", f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        extra = sorted(set(t) - {"type", "function"})
        if extra:
            raise _bad("tools", f"{where} has an unknown field '{extra[0]}'")
        fn = t["function"]
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise _bad("tools", f"{where}.function has an unknown field '{unknown[0]}'")
        if not isinstance(fn.get("name"), str) or not _NAME_RE.match(fn["name"]):
            raise _bad("tools", f"{where}.function.name must be 1-64 letters, digits, '_' or '-'")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad("tools", f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad("tools", f"{where}.function.parameters must be a JSON schema object")
        checked.append({"type": "function", "function": {k: v for k, v in fn.items() if k != "strict"}})
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise _bad("tools", "two tools have the same name")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if fn["name"] not in names:
            raise _bad("tool_choice", f"'tool_choice' names '{fn['name'][:64]}', which is not among the tools")
        choice = fn["name"]
    elif choice not in ("auto", "none", "required"):
        raise _bad("tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or a named function")
    req = ToolRequest(tuple(checked), choice, parallel is not False)
    grammar = tool_grammar(req)
    if grammar is not None:   # depth only: Serving.prepare parses it, off the event loop
        from pdserve.engine.config import MAX_DEPTH_CEILING, StructuredLimits
        from pdserve.engine.structured import check_limits

        try:
            check_limits(grammar, StructuredLimits(max_depth=MAX_DEPTH_CEILING))
        except InvalidRequestError as exc:
            raise _bad("tools", f"a tool's parameters schema does not compile: {exc}") from None
    return req


def _call_schema(req: ToolRequest, name: str) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": name}, "arguments": req.schema_of(name)}}


def tool_grammar(req: ToolRequest) -> StructuredOutput | None:
    """The grammar for ``req.choice``; None for ``none`` (free text). ``auto``: free text with
    calls in their blocks; ``required``: a JSON array of calls (one with ``parallel_tool_calls``
    false); a named function: its arguments object alone."""
    if req.choice == "none":
        return None
    if req.choice == "auto":
        tags = [{"begin": f'{OPEN}{{"name": "{n}", "arguments": ', "schema": req.schema_of(n), "end": f"}}{CLOSE}"}
                for n in req.names]
        return StructuredOutput("structural_tag", json.dumps({"tags": tags, "triggers": [OPEN]}))
    if req.choice == "required":
        calls = [_call_schema(req, n) for n in req.names]
        array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not req.parallel:
            array["maxItems"] = 1
        return StructuredOutput("json_schema", json.dumps(array))
    return StructuredOutput("json_schema", json.dumps(req.schema_of(req.choice)))


def render_messages(messages: list[dict], req: ToolRequest | None, template_reads_tools: bool) -> list[dict]:
    """Messages for a template that does not read ``tools``/``tool_calls``: the tools described
    in the system turn, earlier calls written out in the call format."""
    out = []
    for m in messages:
        plain = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if m.get("tool_calls"):
            text = "".join(f'{OPEN}{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                           f'{c["function"]["arguments"]}}}{CLOSE}' for c in m["tool_calls"])
            out.append({**plain, "content": (m.get("content") or "") + text})
        else:
            out.append({**plain, "content": m.get("content") or ""})
    if req is not None and not template_reads_tools:
        described = "\n".join(json.dumps(t["function"]) for t in req.tools)
        note = TOOL_PROMPT.format(tools=described)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


_CALL_RE = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str | None
    tool_calls: list[dict]


def _call(name: str, arguments: object) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def parse_reply(text: str, req: ToolRequest) -> ParsedReply:
    """Split the model's text into content and OpenAI ``tool_calls``. ``required`` and a named
    function wrote JSON under their grammar; ``auto`` wrote text with call blocks (a block that
    is not a call of a known tool stays in the content). Output cut short by ``max_tokens`` is no
    complete call: it stays content."""
    if req.choice not in ("auto", "none"):
        try:
            obj = json.loads(text)
        except ValueError:
            return ParsedReply(text or None, [])
        if req.choice == "required":
            return ParsedReply(None, [_call(c["name"], c["arguments"]) for c in obj])
        return ParsedReply(None, [_call(req.choice, obj)])
    calls, kept, last = [], [], 0
    for m in _CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in req.names or not isinstance(obj.get("arguments"), dict):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(_call(obj["name"], obj["arguments"]))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return ParsedReply(content or None, calls)


def may_open_a_call(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``<tool_call>``: a
    stream holds them back until it knows."""
    for n in range(min(len(OPEN), len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def check_message(where: str, msg: dict) -> dict:
    """The tool parts of one chat message: an assistant's ``tool_calls``, a tool's ``tool_call_id``."""
    out: dict[str, Any] = {}
    calls = msg.get("tool_calls")
    if calls is not None:
        if msg.get("role") != "assistant" or not isinstance(calls, list):
            raise _bad("messages", f"{where}.tool_calls belongs to an assistant message and must be a list")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
                raise _bad("messages", f"{where}.tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                                       "{\"name\": ..., \"arguments\": \"<JSON text>\"}}")
            try:
                json.loads(fn["arguments"])
            except ValueError:
                raise _bad("messages", f"{where}.tool_calls[{j}].function.arguments is not JSON text") from None
        out["tool_calls"] = calls
    if msg.get("role") == "tool":
        if not isinstance(msg.get("tool_call_id"), str):
            raise _bad("messages", f"{where} is a tool result: it needs its 'tool_call_id'")
        out["tool_call_id"] = msg["tool_call_id"]
    return out


class ToolStream:
    """A streamed reply under tools: content is sent as it comes, except text that is (or may
    become) a call; the calls are parsed at the end."""

    def __init__(self, req: ToolRequest) -> None:
        self.req = req
        self.text = ""
        self._sent = 0
        self._in_call = req.choice not in ("auto", "none")   # required / named: all of it is calls

    def push(self, delta: str) -> str:
        """Add text; return the content that may be sent now."""
        self.text += delta
        if self._in_call:
            return ""
        start = self.text.find(OPEN, self._sent)
        end = start if start >= 0 else len(self.text) - may_open_a_call(self.text[self._sent:])
        if start >= 0:
            self._in_call = True
        out = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return out

    def finish(self) -> ParsedReply:
        """What is left: content not sent yet, and the calls."""
        if self.req.choice not in ("auto", "none"):
            return parse_reply(self.text, self.req)
        rest = parse_reply(self.text[self._sent:], self.req)
        return rest if rest.tool_calls else ParsedReply(self.text[self._sent:] or None, [])
