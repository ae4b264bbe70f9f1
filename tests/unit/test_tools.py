"""Tools (function calling): what the router checks, writes into the prompt and reads back."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.router.tools import (OPEN, ToolRequest, ToolStream, parse_reply, parse_tools, render_messages,
                                  tool_grammar)
from pdserve.router.validation import parse_chat_body, parse_completion_body

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**kw) -> dict:
    return {"messages": USER, **kw}


def test_tool_choice_picks_the_grammar() -> None:
    kinds = {}
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "add"}}):
        req = parse_tools({"tools": [WEATHER, ADD], "tool_choice": choice})
        g = tool_grammar(req)
        kinds[req.choice] = None if g is None else (g.kind, json.loads(g.spec))
    assert kinds["none"] is None
    assert kinds["auto"][0] == "structural_tag" and kinds["auto"][1]["triggers"] == [OPEN]
    assert kinds["required"][0] == "json_schema" and kinds["required"][1]["minItems"] == 1
    assert "maxItems" not in kinds["required"][1]
    assert kinds["add"] == ("json_schema", ADD["function"]["parameters"])
    one = tool_grammar(parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}))
    assert json.loads(one.spec)["maxItems"] == 1
    parsed = parse_chat_body(chat(tools=[WEATHER]))
    assert parsed.tools.choice == "auto" and parsed.sampling_params(8).structured.kind == "structural_tag"
    assert parse_chat_body(chat(tools=[WEATHER], tool_choice="none")).sampling_params(8).structured is None


@pytest.mark.parametrize("body, param, words", [
    (chat(tool_choice="auto"), "tool_choice", "needs 'tools'"),
    (chat(parallel_tool_calls=True), "parallel_tool_calls", "needs 'tools'"),
    (chat(tools=[{"type": "function"}]), "tools", "must be"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools", "letters, digits"),
    (chat(tools=[WEATHER, WEATHER]), "tools", "same name"),
    (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "not among the tools"),
    (chat(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "must be"),
    (chat(tools=[WEATHER], response_format={"type": "json_object"}), "tool_choice", "send one of them"),
    (chat(tools=[WEATHER], tool_choice="required", ignore_eos=True), "tool_choice", "ignore_eos"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                      "arguments": "{"}}]}]},
     "messages", "not JSON text"),
    ({"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages", "unknown field 'colour'"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions", "send them as 'tools'"),
])
def test_bad_tool_requests_name_the_field(body, param, words) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_body(body)
    assert info.value.param == param and words in str(info.value), str(info.value)


def test_tools_belong_to_chat() -> None:
    with pytest.raises(InvalidRequestError, match="belongs to /v1/chat/completions"):
        parse_completion_body({"prompt": "x", "tools": [WEATHER]})


def test_a_template_without_tools_gets_them_in_the_system_turn_and_calls_as_text() -> None:
    req = parse_tools({"tools": [WEATHER]})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "system", "content": "Be brief."}, *USER,
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    out = render_messages(history, req, template_reads_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"] and OPEN in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'}
    assert out[3] == {"role": "tool", "content": "18 C"}
    assert render_messages(USER, req, template_reads_tools=False)[0]["role"] == "system"  # added when absent


def test_replies_split_into_content_and_calls() -> None:
    req = ToolRequest((WEATHER, ADD), "auto")
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' \
           '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    reply = parse_reply(text, req)
    assert [json.loads(c["function"]["arguments"]) for c in reply.tool_calls] == [{"city": "Oslo"}]
    assert reply.tool_calls[0]["id"].startswith("call_") and reply.tool_calls[0]["type"] == "function"
    assert reply.content.startswith("Let me check.") and '"nope"' in reply.content   # an unknown tool stays text
    assert parse_reply("just text", req) == parse_reply("just text", req) and not parse_reply("just text", req).tool_calls
    required = parse_reply('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', ToolRequest((ADD,), "required"))
    assert required.content is None and required.tool_calls[0]["function"]["name"] == "add"
    named = parse_reply('{"a": 3, "b": 4}', ToolRequest((ADD,), "add"))
    assert json.loads(named.tool_calls[0]["function"]["arguments"]) == {"a": 3, "b": 4}
    cut = parse_reply('[{"name": "add", "argu', ToolRequest((ADD,), "required"))      # max_tokens cut it
    assert cut.tool_calls == [] and cut.content == '[{"name": "add", "argu'


def test_a_stream_holds_back_what_may_become_a_call() -> None:
    s = ToolStream(ToolRequest((WEATHER,), "auto"))
    sent = [s.push(d) for d in ("Sure", ". <tool", "_call>", '{"name": "get_weather", "arguments": {"city": "Rome"}}',
                                "</tool_call>")]
    assert "".join(sent) == "Sure. " and sent[1] == ". "     # "<tool" was held, then known to open a call
    rest = s.finish()
    assert rest.content is None and json.loads(rest.tool_calls[0]["function"]["arguments"]) == {"city": "Rome"}
    plain = ToolStream(ToolRequest((WEATHER,), "auto"))
    assert "".join(plain.push(d) for d in ("a <to", "ast> b")) == "a <toast> b" and plain.finish().tool_calls == []
