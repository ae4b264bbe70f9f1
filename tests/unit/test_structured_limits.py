"""Structured outputs' limits at the router: the depth of a spec is counted on its text before
anything parses it, and the grammar is parsed by ``Serving.prepare`` on a thread, within
``structured.compile_timeout_s``, so the event loop runs on; every refusal is a 400 naming its
field and the setting."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pdserve.engine.config import StructuredLimits
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.structured import StructuredOutput, check_limits, group_depth, json_depth
from pdserve.router.errors import InvalidParameterError
from pdserve.router.serving import Serving, ServingLimits
from pdserve.router.validation import parse_chat_body, parse_completion_body
from test_router_serving import ScriptedBackend


def deep_array_schema(depth: int) -> str:
    """The issue's hostile schema: ``{"type":"array","items":`` nested ``depth`` deep."""
    return '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from pdserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


def prepare(tiny_model, tokenizer, parsed, limits: StructuredLimits | None = None):
    serving = Serving(ScriptedBackend(str(tiny_model), [10, 11]), tokenizer=tokenizer,
                      limits=ServingLimits(structured=limits or StructuredLimits()))
    return asyncio.run(serving.prepare(parsed, "c", default_max_tokens=4))


# ------------------------------------------------------------------ the scanners
def test_depth_is_counted_on_the_text_outside_strings_escapes_and_classes() -> None:
    assert json_depth('{"a": "[[[{{{", "b": [[{}]], "c": "\\"["}') == 4
    assert json_depth("[" * 500, limit=64) == 65     # stops counting past the limit
    assert json_depth(deep_array_schema(900)) > 256
    assert group_depth(r"((a)\(\)[(((])") == 2
    assert group_depth('root ::= "(((" ((x)) [(]', ebnf=True) == 2
    assert group_depth("(" * 40 + ")" * 40) == 40


def test_check_limits_refuses_a_spec_deeper_than_max_depth_and_names_the_setting() -> None:
    limits = StructuredLimits(max_depth=8)
    check_limits(StructuredOutput("json_schema", deep_array_schema(7)), limits)   # 8 levels: allowed
    for s in (StructuredOutput("json_schema", deep_array_schema(8)),
              StructuredOutput("regex", "(" * 9 + "a" + ")" * 9),
              StructuredOutput("grammar", "root ::= " + "(" * 9 + '"a"' + ")" * 9)):
        with pytest.raises(InvalidRequestError, match=r"more than 8 .*structured\.max_depth"):
            check_limits(s, limits)


# ------------------------------------------------------------------- at parse time
def test_guided_json_text_nested_2500_deep_is_a_400_before_json_parses_it() -> None:
    """It was a 500: ``json.loads`` raised RecursionError."""
    with pytest.raises(InvalidParameterError, match=r"structured\.max_depth") as info:
        parse_completion_body({"prompt": "x", "guided_json": "[" * 2500 + "]" * 2500})
    assert info.value.param == "guided_json" and info.value.http_status == 400
    with pytest.raises(InvalidParameterError, match=r"at most 65536 characters"):
        parse_completion_body({"prompt": "x", "guided_json": " " * 70000 + "{}"})


# ------------------------------------------------------------- in Serving.prepare
@pytest.mark.parametrize("body, field, words", [
    ({"prompt": "x", "guided_json": {"type": "object", "properties": 3}}, "guided_json", "could not be compiled"),
    ({"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex", "could not be compiled"),
    ({"prompt": "x", "guided_grammar": "root ::= "}, "guided_grammar", "could not be compiled"),
    ({"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "could not be compiled"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}]},
     "tools", "does not compile"),
])
def test_a_malformed_grammar_is_a_400_naming_its_field(tiny_model, tokenizer, body, field, words) -> None:
    parsed = parse_chat_body(body) if "messages" in body else parse_completion_body(body)
    with pytest.raises(InvalidParameterError, match=words) as info:
        prepare(tiny_model, tokenizer, parsed)
    assert info.value.param == field and info.value.http_status == 400


def test_the_configured_max_depth_applies_in_prepare(tiny_model, tokenizer) -> None:
    parsed = parse_completion_body({"prompt": "x", "guided_json": json.loads(deep_array_schema(12))})
    prepare(tiny_model, tokenizer, parsed)   # 13 levels: within the default 64
    with pytest.raises(InvalidParameterError, match=r"more than 8 levels of JSON.*structured\.max_depth") as info:
        prepare(tiny_model, tokenizer, parsed, StructuredLimits(max_depth=8))
    assert info.value.param == "guided_json"


def test_a_parse_past_the_budget_is_a_400_and_the_event_loop_runs_on(tiny_model, tokenizer) -> None:
    """A 200-deep schema takes xgrammar ~0.4 s to parse here; with a 0.05 s budget it is refused at
    the budget, and a task ticking every 5 ms meanwhile is never held up."""
    parsed = parse_completion_body({"prompt": "x", "guided_json": deep_array_schema(200)})
    serving = Serving(ScriptedBackend(str(tiny_model), [10]), tokenizer=tokenizer,
                      limits=ServingLimits(structured=StructuredLimits(compile_timeout_s=0.05, max_depth=256)))

    async def go() -> tuple[float, float]:
        gaps, stop = [0.0], asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps[0], last = max(gaps[0], now - last), now
        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        with pytest.raises(InvalidParameterError, match=r"within 0\.05 s \(structured\.compile_timeout_s\)") as info:
            await serving.prepare(parsed, "c", default_max_tokens=4)
        took = time.monotonic() - t0
        stop.set()
        await ticker
        assert info.value.param == "guided_json" and info.value.code == "grammar_refused"
        return took, gaps[0]

    took, gap = asyncio.run(go())
    assert took < 0.3, took
    assert gap < 0.1, gap
