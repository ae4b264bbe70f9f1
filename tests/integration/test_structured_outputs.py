"""Structured outputs in the engine (tiny random-weight model, real xgrammar): every sampled token
follows the request's grammar, free requests in the same batch are untouched, and the grammar's
state follows a request that continues elsewhere (a decode worker after its prefill, a
migration) token for token."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import StructuredOutput

# Bounded everywhere (string lengths, integer range, enums), so that even a random-weight model
# completes the document well inside max_tokens: a truncated document would not parse.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "silver", "bronze"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "tier", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=512, max_num_seqs=32, warm_up=False))


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return list(engine.stopper.tokenizer("Describe the customer as JSON:")["input_ids"])


def text(engine: LLMEngine, ids: list[int]) -> str:
    return engine.stopper.tokenizer.decode(ids, skip_special_tokens=True)


def sampled(structured: StructuredOutput, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=seed, structured=structured, **kw)


def test_twenty_seeded_samples_parse_and_validate_against_the_schema(engine, prompt) -> None:
    s = StructuredOutput("json_schema", json.dumps(SCHEMA))
    outs = engine.generate([prompt] * 20, [sampled(s, seed) for seed in range(20)])
    docs = [json.loads(text(engine, o)) for o in outs]
    for doc in docs:
        jsonschema.validate(doc, SCHEMA)
    assert all(o[-1] in engine.spec.eos_token_ids for o in outs)  # ended by EOS, not by length
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > 5  # the seeds sampled, not one fixed answer
    # the same model without the grammar writes no JSON at all
    free = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.9, seed=0))[0]
    with pytest.raises(ValueError):
        json.loads(text(engine, free))


def test_regex_choice_and_grammar_constrain_every_sample(engine, prompt) -> None:
    cases = [
        (StructuredOutput("regex", r"[A-Z]{2}-[0-9]{3}"), lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t)),
        (StructuredOutput("choice", json.dumps(["yes", "no", "not sure"])), lambda t: t in ("yes", "no", "not sure")),
        (StructuredOutput("grammar", 'root ::= "(" num ("+" num){0,2} ")"\nnum ::= [0-9]{1,3}'),
         lambda t: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3}){0,2}\)", t)),
    ]
    for s, ok in cases:
        outs = engine.generate([prompt] * 8, [sampled(s, seed) for seed in range(8)])
        for o in outs:
            assert o[-1] in engine.spec.eos_token_ids and ok(text(engine, o)), (s.kind, text(engine, o))


def test_json_object_greedy_starts_an_object(engine, prompt) -> None:
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                   structured=StructuredOutput("json_object")))[0]
    assert text(engine, out).lstrip().startswith("{")


def test_a_constrained_request_leaves_its_free_neighbours_token_identical(engine, prompt) -> None:
    others = [list(engine.stopper.tokenizer(p)["input_ids"]) for p in ("Once upon a time", "def main():")]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    alone = engine.generate(others, greedy)
    mixed = engine.generate([*others, prompt], [greedy, greedy,
                                                sampled(StructuredOutput("json_schema", json.dumps(SCHEMA)), 1)])
    assert mixed[:2] == alone
    jsonschema.validate(json.loads(text(engine, mixed[2])), SCHEMA)


def test_the_grammar_follows_a_request_that_continues_elsewhere(engine, prompt) -> None:
    """A migration re-prefills prompt + what the client got, and the grammar consumes those tokens
    first (``SamplingParams.prior_output``): the continuation is the uninterrupted output's tail,
    greedy and seeded alike."""
    s = StructuredOutput("json_schema", json.dumps(SCHEMA))
    whole = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured=s))[0]
    cut = len(whole) // 2
    rest = engine.generate([prompt + whole[:cut]], SamplingParams(max_tokens=MAX_TOKENS - cut, temperature=0,
                                                                 structured=s, prior_output=whole[:cut]))[0]
    assert whole[:cut] + rest == whole
    seeded = dict(temperature=0.9, seed=7, structured=s, frequency_penalty=0.5)
    whole = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, **seeded))[0]
    cut = len(whole) // 2
    rest = engine.generate([prompt + whole[:cut]], SamplingParams(max_tokens=MAX_TOKENS - cut, prior_output=whole[:cut],
                                                                 **seeded))[0]
    assert whole[:cut] + rest == whole
    # without the tokens already emitted, the grammar would start a new document mid-object
    fresh = engine.generate([prompt + whole[:cut]], SamplingParams(max_tokens=MAX_TOKENS - cut, temperature=0,
                                                                  structured=s))[0]
    assert whole[:cut] + fresh != whole


def test_a_decode_side_sequence_consumes_the_prefilled_first_token(engine, prompt) -> None:
    """``add_prefilled`` (a decode worker taking over after a prefill worker) advances the grammar
    by the first token; a first token the grammar forbids is refused by name."""
    s = StructuredOutput("choice", json.dumps(["yes", "no"]))
    greedy = SamplingParams(max_tokens=8, temperature=0, structured=s)
    whole = engine.generate([prompt], greedy)[0]
    blocks = engine.reserve(-(-(len(prompt) + 8) // engine.config.block_size))
    engine.release_reserved(blocks)
    forbidden = engine.stopper.tokenizer(" maybe", add_special_tokens=False)["input_ids"][0]
    blocks = engine.reserve(-(-(len(prompt) + 8) // engine.config.block_size))
    with pytest.raises(InvalidRequestError, match="does not follow"):
        engine.add_prefilled("bad-first", prompt, forbidden, greedy, blocks)
    engine.release_reserved(blocks)
    assert engine.block_manager.all_free()
    assert text(engine, whole) in ("yes", "no")


def test_conflicting_parameters_are_refused() -> None:
    s = StructuredOutput("json_object")
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(structured=s, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(structured=s, min_tokens=2)
    with pytest.raises(InvalidRequestError, match="kind"):
        StructuredOutput("xml")


def test_after_the_trigger_a_tool_call_follows_its_schema(engine, prompt) -> None:
    """tool_choice auto's grammar: free text, and once ``<tool_call>`` is written (here given as
    already emitted) the call's name and schema-valid arguments, then the closing tag."""
    from pdserve.router.tools import ToolRequest, parse_reply, tool_grammar

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}}
    req = ToolRequest((weather,), "auto")
    trigger = engine.stopper.tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]
    grammar = tool_grammar(req)
    for seed in range(5):
        out = engine.generate([prompt + trigger], SamplingParams(max_tokens=240, temperature=0.9, seed=seed,
                                                                 structured=grammar, prior_output=trigger))[0]
        reply = parse_reply("<tool_call>" + text(engine, out), req)
        assert [c["function"]["name"] for c in reply.tool_calls] == ["get_weather"], text(engine, out)
        assert set(json.loads(reply.tool_calls[0]["function"]["arguments"])) == {"city"}
