"""Request validation at the door, and how its errors reach clients (status, OpenAI body)."""

from __future__ import annotations

import json
import re

import grpc
import pytest

from pdserve.engine.errors import (
    AuthenticationError,
    DeadlineExceededError,
    EngineStepError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    PdserveError,
    SamplingError,
    WorkerUnavailableError,
    request_error,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Priority
from pdserve.router import errors
from pdserve.router.auth import ApiKeyAuth
from pdserve.router.validation import (
    check_model,
    check_prompt_tokens,
    check_request_id,
    parse_chat_body,
    parse_completion_body,
    parse_generate_fields,
    resolve_max_tokens,
)


def completion(**fields):
    return {"model": "tiny", "prompt": "hello", **fields}


def chat(**fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


# ------------------------------------------------------------------ valid inputs
def test_completion_body_with_every_supported_field() -> None:
    req = parse_completion_body(completion(
        max_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=11, stop=["\n", "END"], stop_token_ids=[4],
        ignore_eos=True, logprobs=2, stream=True, stream_options={"include_usage": True}, priority="batch",
        n=1, echo=False, presence_penalty=0))
    assert (req.prompt_text, req.max_tokens, req.stream, req.include_usage) == ("hello", 7, True, True)
    assert req.priority is Priority.BATCH
    params = req.sampling_params(req.max_tokens)
    assert params.greedy and params.top_p == 0.5 and params.top_k == 3 and params.seed == 11
    assert params.stop == ("\n", "END") and params.stop_token_ids == (4,) and params.ignore_eos
    assert params.logprobs == 2


@pytest.mark.parametrize("prompt, text, ids", [
    ("abc", "abc", None),
    ([1, 2, 3], None, [1, 2, 3]),
    (["abc"], "abc", None),
    ([[5, 6]], None, [5, 6]),
])
def test_completion_prompt_forms(prompt, text, ids) -> None:
    req = parse_completion_body(completion(prompt=prompt))
    assert (req.prompt_text, req.prompt_token_ids) == (text, ids)


def test_chat_body_joins_text_parts_and_reads_logprob_fields() -> None:
    req = parse_chat_body(chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], max_completion_tokens=5, logprobs=True, top_logprobs=3))
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert req.max_tokens == 5 and req.sampling["logprobs"] == 3


def test_stop_string_alone_becomes_a_tuple() -> None:
    assert parse_completion_body(completion(stop="###")).sampling["stop"] == ("###",)


# ---------------------------------------------------------------- invalid inputs
@pytest.mark.parametrize("body, param, words", [
    ([1, 2], None, "JSON object"),
    ({"model": "tiny"}, "prompt", "required"),
    (completion(prompt=""), "prompt", "empty"),
    (completion(prompt=[]), "prompt", "empty list"),
    (completion(prompt=5), "prompt", "string or a list of token ids"),
    (completion(prompt=[1, "a"]), "prompt", "integer token ids"),
    (completion(prompt=[1, -2]), "prompt", "non-negative"),
    (completion(prompt=["a", ""]), "prompt", "'prompt[1]' is empty"),
    (completion(prompt=["a"] * 33, n=2), "prompt", "33 prompts x 2 choices"),
    (completion(max_tokens=0), "max_tokens", "at least 1"),
    (completion(max_tokens="10"), "max_tokens", "must be an integer"),
    (completion(max_tokens=True), "max_tokens", "must be an integer"),
    (completion(max_tokens=2.5), "max_tokens", "must be an integer"),
    (completion(temperature=-0.1), "temperature", "between 0.01 and 2.0, or 0 (greedy)"),
    (completion(temperature=2.5), "temperature", "between 0.01 and 2.0, or 0 (greedy)"),
    # Tiny temperatures overflow logits / temperature to inf (NaN after softmax).
    (completion(temperature=1e-300), "temperature", "between 0.01 and 2.0, or 0 (greedy)"),
    (completion(temperature=1e-39), "temperature", "between 0.01 and 2.0, or 0 (greedy)"),
    (completion(temperature=0.009), "temperature", "between 0.01 and 2.0, or 0 (greedy)"),
    (completion(temperature="hot"), "temperature", "finite number"),
    (completion(temperature=float("nan")), "temperature", "finite number"),
    (completion(top_p=0), "top_p", "at least 1e-06) and at most 1"),
    (completion(top_p=1.5), "top_p", "at least 1e-06) and at most 1"),
    # Below float32's range top_p becomes 0 and filters out every token.
    (completion(top_p=1e-300), "top_p", "at least 1e-06) and at most 1"),
    (chat(top_p=1e-7), "top_p", "at least 1e-06) and at most 1"),
    (chat(temperature=1e-300), "temperature", "between 0.01 and 2.0, or 0 (greedy)"),
    (completion(seed=2**64), "seed", "at most 18446744073709551615"),
    (completion(seed=-(2**63) - 1), "seed", "at least -9223372036854775808"),
    (completion(top_k=-1), "top_k", "at least 0"),
    (completion(stop=[""]), "stop", "non-empty"),
    (completion(stop=["x"] * 17), "stop", "at most 16"),
    (completion(stream="yes"), "stream", "true or false"),
    (completion(stream_options={"include_usage": True}), "stream_options", "only allowed when 'stream' is true"),
    (completion(logprobs=21), "logprobs", "at most 20"),
    (completion(n=0), "n", "at least 1"),
    (completion(n=17), "n", "router.max_choices_per_request"),
    (completion(n=3, best_of=2), "best_of", "at least 'n'"),
    (completion(best_of=2, stream=True), "best_of", "cannot be streamed"),
    (completion(echo=True, logprobs=1, stream=True), "echo", "cannot be streamed"),
    (completion(prompt_logprobs=1, stream=True), "prompt_logprobs", "cannot be streamed"),
    (completion(prompt_logprobs=21), "prompt_logprobs", "at most 20"),
    (completion(max_tokens=0), "max_tokens", "at least 1"),
    (completion(max_tokens=0, echo=True, stream=True), "max_tokens", "cannot be streamed"),
    (chat(best_of=2), "best_of", "belongs to /v1/completions"),
    (completion(presence_penalty=2.5), "presence_penalty", "between -2 and 2"),
    (chat(frequency_penalty=-3), "frequency_penalty", "between -2 and 2"),
    (completion(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    (completion(min_p=1.5), "min_p", "between 0 and 1"),
    (chat(min_tokens=-1), "min_tokens", "at least 0"),
    (completion(priority="urgent"), "priority", "interactive"),
    (completion(model=3), "model", "must be a string"),
    (chat(messages=[]), "messages", "non-empty list"),
    (chat(messages="hi"), "messages", "non-empty list"),
    (chat(messages=[{"role": "robot", "content": "x"}]), "messages", "messages[0].role"),
    (chat(messages=[{"role": "user", "content": 3}]), "messages", "string or a list of text parts"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "messages",
     "only text content"),
    (chat(top_logprobs=2), "top_logprobs", "needs 'logprobs': true"),
    (chat(logprobs=1), "logprobs", "true or false"),
    # never silently ignored: unknown and unimplemented fields are refused by name
    (completion(frequency_penaltyy=0.5), "frequency_penaltyy", "unknown parameter 'frequency_penaltyy'"),
    (completion(max_completion_tokens=5), "max_completion_tokens", "belongs to /v1/chat/completions"),
    (chat(prompt="x"), "prompt", "belongs to /v1/completions"),
    (chat(response_format={"type": "xml"}), "response_format", "must be"),
    (chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format", "needs 'json_schema'"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                  "strict": "yes"}}), "response_format", "strict"),
    (chat(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex", "send one of them"),
    (chat(response_format={"type": "json_object"}, ignore_eos=True), "ignore_eos", "cannot be combined"),
    (completion(guided_json="{not json"), "guided_json", "JSON schema"),
    (completion(guided_choice=[]), "guided_choice", "list of 1 to"),
    (completion(logit_bias=[1, 2]), "logit_bias", "must be an object"),
    (completion(logit_bias={"abc": 1}), "logit_bias", "keys must be token ids"),
    (completion(logit_bias={"5": 200}), "logit_bias", "between -100 and 100"),
    (completion(logit_bias={"5": True}), "logit_bias", "between -100 and 100"),
    (completion(guided_choice=["a", 3]), "guided_choice", "non-empty strings"),
    (completion(guided_grammar="x" * 70000), "guided_grammar", "at most"),
    (chat(tool_choice="auto"), "tool_choice", "needs 'tools'"),
    (chat(parallel_tool_calls=True), "parallel_tool_calls", "needs 'tools'"),
    (chat(store=True), "store", "not supported"),
    (chat(metadata={"a": "b"}), "metadata", "not supported"),
    (chat(user="u-1"), "user", "unknown parameter 'user'"),
])
def test_invalid_bodies_name_the_field_and_the_fix(body, param, words) -> None:
    parse = parse_chat_body if isinstance(body, dict) and "messages" in body else parse_completion_body
    with pytest.raises(InvalidRequestError) as info:
        parse(body)
    assert info.value.param == param
    assert words in str(info.value)
    assert errors.http_status(info.value) == 400
    assert errors.grpc_status_code(info.value) is grpc.StatusCode.INVALID_ARGUMENT


def test_prompt_checks_after_tokenization() -> None:
    check_prompt_tokens([1, 2, 3], vocab_size=10, max_model_len=8)
    with pytest.raises(InvalidRequestError, match="empty after tokenization"):
        check_prompt_tokens([], 10, 8)
    with pytest.raises(InvalidRequestError, match=r"token id 10 is outside the vocabulary \[0, 10\)"):
        check_prompt_tokens([1, 10], 10, 8)
    with pytest.raises(InvalidRequestError, match="shorten the prompt to at most 7 tokens") as info:
        check_prompt_tokens([1] * 8, 10, 8)
    assert info.value.code == "context_length_exceeded"


def test_max_tokens_is_checked_against_the_room_left_in_the_context() -> None:
    assert resolve_max_tokens(None, prompt_len=10, max_model_len=64, default=16) == 16
    assert resolve_max_tokens(None, prompt_len=60, max_model_len=64, default=16) == 4
    assert resolve_max_tokens(None, prompt_len=10, max_model_len=64, default=None) == 54
    assert resolve_max_tokens(54, prompt_len=10, max_model_len=64, default=16) == 54
    with pytest.raises(InvalidRequestError, match="lower max_tokens to at most 54") as info:
        resolve_max_tokens(55, prompt_len=10, max_model_len=64, default=16)
    assert info.value.param == "max_tokens"


def test_unknown_model_is_not_found() -> None:
    check_model(None, "tiny")
    check_model("tiny", "tiny")
    with pytest.raises(ModelNotFoundError, match="serves 'tiny'") as info:
        check_model("gpt-9", "tiny")
    body = errors.openai_error_body(info.value)["error"]
    assert (errors.http_status(info.value), body["code"], body["param"]) == (404, "model_not_found", "model")


def test_request_ids() -> None:
    assert check_request_id("abc-123_X") == "abc-123_X"
    for bad in ("has space", "x" * 129, "é"):
        with pytest.raises(InvalidRequestError, match="printable ASCII"):
            check_request_id(bad)


def test_grpc_fields() -> None:
    req = parse_generate_fields("", None, [1, 2], {"max_tokens": 3, "temperature": 0.0}, Priority.BATCH)
    assert req.model is None and req.prompt_token_ids == [1, 2] and req.max_tokens == 3
    with pytest.raises(InvalidRequestError, match="either 'text' or 'token_ids'"):
        parse_generate_fields("", None, None, {}, Priority.INTERACTIVE)
    with pytest.raises(InvalidRequestError, match="at least 1"):
        parse_generate_fields("", "hi", None, {"max_tokens": 0}, Priority.INTERACTIVE)


@pytest.mark.parametrize("field, value", [("temperature", 1e-300), ("top_p", 1e-300), ("seed", 2**64)])
def test_grpc_sampling_fields_out_of_range_name_the_field(field, value) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_generate_fields("", "hi", None, {field: value}, Priority.INTERACTIVE)
    assert info.value.param == field and field in str(info.value)
    assert errors.grpc_status_code(info.value) is grpc.StatusCode.INVALID_ARGUMENT


def test_sampling_limits_accept_their_edges() -> None:
    req = parse_completion_body(completion(temperature=0.01, top_p=1e-6, seed=2**64 - 1))
    params = req.sampling_params(4)
    assert (params.temperature, params.top_p, params.seed) == (0.01, 1e-6, 2**64 - 1)
    assert parse_completion_body(completion(seed=-(2**63))).sampling["seed"] == -(2**63)


@pytest.mark.parametrize("fields, words", [
    ({"temperature": 1e-300}, "temperature must be 0 (greedy) or a finite number >= 0.01"),
    ({"temperature": 0.001}, "temperature must be 0 (greedy) or a finite number >= 0.01"),
    ({"temperature": float("inf")}, "temperature must be 0 (greedy)"),
    ({"top_p": 1e-300}, "top_p must be in [1e-06, 1]"),
    ({"top_p": float("nan")}, "top_p must be in [1e-06, 1]"),
    ({"seed": 2**64}, "seed must fit in 64 bits"),
])
def test_sampling_params_refuse_values_that_can_overflow(fields, words) -> None:
    """The engine's own check, for callers that build SamplingParams without the router."""
    with pytest.raises(InvalidRequestError, match=re.escape(words)):
        SamplingParams(**fields)


# ------------------------------------------------------------ error mapping
@pytest.mark.parametrize("exc, http, code", [
    (InvalidRequestError("x"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.RequestTooLargeError("x"), 413, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFoundError("x"), 404, grpc.StatusCode.NOT_FOUND),
    (OverloadedError("x", retry_after_s=2.5), 429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AuthenticationError("x"), 401, grpc.StatusCode.UNAUTHENTICATED),
    (DeadlineExceededError("x"), 504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (WorkerUnavailableError("x"), 503, grpc.StatusCode.UNAVAILABLE),
    (PdserveError("x"), 500, grpc.StatusCode.INTERNAL),
    (SamplingError("x"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineStepError("x"), 500, grpc.StatusCode.INTERNAL),
    (RuntimeError("secret internals"), 500, grpc.StatusCode.INTERNAL),
])
def test_each_error_maps_to_one_grpc_and_one_http_status(exc, http, code) -> None:
    assert errors.http_status(exc) == http
    assert errors.grpc_status_code(exc) is code
    body = errors.openai_error_body(exc)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "secret" not in body["error"]["message"]


def test_a_workers_request_error_code_becomes_its_typed_400() -> None:
    err = request_error("sampling_failed", "request r: no valid distribution")
    assert isinstance(err, SamplingError) and str(err) == "request r: no valid distribution"
    assert errors.http_status(err) == 400
    assert errors.openai_error_body(err)["error"]["code"] == "sampling_failed"
    assert request_error(EngineStepError.code, "x") is None and request_error(None, "x") is None


def test_overload_tells_when_to_retry() -> None:
    exc = OverloadedError("full", retry_after_s=2.5)
    assert errors.retry_after_seconds(exc) == 3
    assert errors.grpc_trailing_metadata(exc) == (("retry-after-ms", "2500"),)
    assert errors.openai_error_body(exc)["error"]["code"] == "rate_limit_exceeded"
    assert errors.retry_after_seconds(InvalidRequestError("x")) is None


# ---------------------------------------------------------------------- auth
def test_api_keys() -> None:
    ApiKeyAuth().check(None)  # no keys configured: open
    auth = ApiKeyAuth(["k1", " k2 ", ""])
    auth.check("Bearer k1")
    auth.check("bearer k2")
    for header, words in ((None, "missing API key"), ("k1", "malformed"), ("Bearer ", "malformed"),
                          ("Bearer k3", "invalid API key"), ("Basic k1", "malformed")):
        with pytest.raises(AuthenticationError, match=words):
            auth.check(header)


def test_neutral_values_of_unimplemented_fields_are_accepted() -> None:
    """What clients send by default changes nothing."""
    body = completion(n=1, echo=False, store=False)
    assert parse_completion_body(body).prompt_text
    assert parse_chat_body(chat(response_format={"type": "text"}, tool_choice="none")).messages


def test_penalties_min_p_and_min_tokens_reach_the_sampling_params() -> None:
    req = parse_chat_body(chat(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, min_p=0.05,
                               min_tokens=3))
    params = req.sampling_params(8)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p,
            params.min_tokens) == (0.5, -0.25, 1.2, 0.05, 3)
    assert params.adjusts_logits
    neutral = parse_completion_body(completion(repetition_penalty=1.0, min_p=0, min_tokens=0, presence_penalty=0))
    assert not neutral.sampling_params(8).adjusts_logits      # vllm bench serve sends repetition_penalty 1.0
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        parse_chat_body(chat(min_tokens=9)).sampling_params(8)


def test_structured_output_fields_become_the_request_grammar() -> None:
    from pdserve.engine.structured import StructuredOutput

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        (chat(response_format={"type": "json_object"}), StructuredOutput("json_object")),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}),
         StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))),
        (completion(guided_json=schema), StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))),
        (completion(guided_json=json.dumps(schema)), StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))),
        (completion(guided_regex="[0-9]{3}"), StructuredOutput("regex", "[0-9]{3}")),
        (completion(guided_choice=["yes", "no"]), StructuredOutput("choice", '["yes", "no"]')),
        (completion(guided_grammar='root ::= "a" | "b"'), StructuredOutput("grammar", 'root ::= "a" | "b"')),
    ]
    for body, want in cases:
        parse = parse_chat_body if "messages" in body else parse_completion_body
        assert parse(body).sampling_params(8).structured == want, body
    assert parse_chat_body(chat(response_format={"type": "text"})).sampling_params(8).structured is None


def test_grpc_sampling_fields_reach_the_sampling_params() -> None:
    """Every sampling field of the gRPC message is read: penalties, min_p, min_tokens and each kind
    of structured output; a malformed grammar is the same 400-class error as over HTTP."""
    from pdserve.engine.structured import StructuredOutput, check as check_structured
    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.router.grpc_server import parsed_from_proto

    def params(**sampling):
        return parsed_from_proto(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))).sampling_params(8)

    assert params(logit_bias={7: -100.0}).logit_bias == ((7, -100.0),)
    p = params(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3, min_p=0.1, min_tokens=2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (
        0.5, -0.25, 1.3, 0.1, 2)
    assert params(json_schema='{"type": "object"}').structured == StructuredOutput("json_schema", '{"type":"object"}')
    assert params(json_object=True).structured == StructuredOutput("json_object")
    assert params(regex="[0-9]+").structured == StructuredOutput("regex", "[0-9]+")
    assert params(choice=pb.Choices(choices=["a", "b"])).structured == StructuredOutput("choice", '["a", "b"]')
    assert params(grammar='root ::= "x"').structured == StructuredOutput("grammar", 'root ::= "x"')
    # the grammar itself is parsed by Serving.prepare, off the event loop (test_structured_limits.py)
    bad = parsed_from_proto(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(regex="(")))
    assert bad.structured_field == "guided_regex"
    with pytest.raises(InvalidRequestError, match="regex could not be compiled: Regex parsing error") as info:
        check_structured(bad.sampling_params(8).structured)
    assert "regex_converter" not in str(info.value)
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        params(json_object=True, ignore_eos=True)


def test_logit_bias_keys_arrive_as_token_ids() -> None:
    p = parse_completion_body(completion(logit_bias={"17": -100, "3": 5.5})).sampling_params(8)
    assert p.logit_bias == ((3, 5.5), (17, -100.0)) and p.adjusts_logits


def test_several_prompts_n_best_of_and_echo_parse() -> None:
    from pdserve.router.validation import parse_completion_bodies

    many = parse_completion_bodies(completion(prompt=["a", [5, 6]], n=2, best_of=3, echo=True))
    assert [(r.prompt_text, r.prompt_token_ids, r.n, r.best_of, r.echo) for r in many] == [
        ("a", None, 2, 3, True), (None, [5, 6], 2, 3, True)]
    one = parse_chat_body(chat(n=4))
    assert (one.n, one.best_of, one.echo) == (4, 4, False)


def test_one_requests_sequences_are_capped_by_the_setting_named_in_the_400() -> None:
    from pdserve.router.validation import DEFAULT_MAX_CHOICES, parse_completion_bodies

    assert parse_chat_body(chat(n=DEFAULT_MAX_CHOICES)).n == DEFAULT_MAX_CHOICES
    assert parse_chat_body(chat(n=40), max_choices=40).n == 40            # a configured larger share
    cases = [
        (lambda: parse_chat_body(chat(n=5), max_choices=4), "n", "'n' is 5 sequences, more than the 4"),
        (lambda: parse_completion_bodies(completion(n=2, best_of=9), max_choices=8), "best_of", "'best_of' is 9"),
        (lambda: parse_completion_bodies(completion(prompt=["a", "b", "c"], n=3), max_choices=8), "prompt",
         "3 prompts x 3 choices is 9 sequences"),
        (lambda: parse_chat_body(chat(n=5, use_beam_search=True), max_choices=4), "n", "more than the 4"),
        (lambda: parse_generate_fields("", "hi", None, {"n": 3}, Priority.INTERACTIVE, max_choices=2), "n",
         "more than the 2"),
    ]
    for parse, param, words in cases:
        with pytest.raises(InvalidRequestError) as info:
            parse()
        assert info.value.param == param and info.value.code == "too_many_choices", info.value
        assert words in str(info.value) and "router.max_choices_per_request" in str(info.value), str(info.value)


def test_beam_width_is_bounded_by_the_logprobs_a_step_reads() -> None:
    assert parse_chat_body(chat(n=10, use_beam_search=True)).beam_width == 10
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_body(chat(n=11, use_beam_search=True))
    assert info.value.param == "n" and "at most 10" in str(info.value) and "logprobs" in str(info.value)


def test_a_chat_or_tokenize_with_too_many_messages_is_400_before_any_message_is_read() -> None:
    from pdserve.router.validation import MAX_CHAT_MESSAGES, parse_tokenize_body

    many = [{"role": "user", "content": "x"}] * (MAX_CHAT_MESSAGES + 1)
    for parse in (lambda: parse_chat_body(chat(messages=many)), lambda: parse_tokenize_body({"messages": many})):
        with pytest.raises(InvalidRequestError) as info:
            parse()
        assert info.value.param == "messages" and f"at most {MAX_CHAT_MESSAGES}" in str(info.value)
    assert len(parse_tokenize_body({"messages": many[:MAX_CHAT_MESSAGES]}).messages) == MAX_CHAT_MESSAGES


def test_vllms_structured_outputs_field_maps_to_the_guided_ones() -> None:
    from pdserve.engine.structured import StructuredOutput

    schema = {"type": "object"}
    for so, want in (({"json": schema}, StructuredOutput("json_schema", '{"type":"object"}')),
                     ({"regex": "[a-z]+"}, StructuredOutput("regex", "[a-z]+")),
                     ({"choice": ["x", "y"]}, StructuredOutput("choice", '["x", "y"]')),
                     ({"json_object": True}, StructuredOutput("json_object"))):
        assert parse_completion_body(completion(structured_outputs=so)).sampling_params(4).structured == want
    for so, words in (({"regex": "a", "choice": ["b"]}, "exactly one"), ({"xml": "x"}, "unknown field 'xml'"),
                      ("json", "must be an object")):
        with pytest.raises(InvalidRequestError, match=words):
            parse_completion_body(completion(structured_outputs=so))
    with pytest.raises(InvalidRequestError, match="send one of them"):
        parse_completion_body(completion(structured_outputs={"regex": "a"}, guided_regex="b"))


def test_docs_api_lists_every_field_the_endpoints_accept() -> None:
    from pathlib import Path

    from pdserve.router import validation

    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    missing = sorted(f for f in validation._COMPLETION_FIELDS | validation._CHAT_FIELDS if f"`{f}`" not in doc)
    assert not missing, f"docs/api.md does not describe {missing}"
