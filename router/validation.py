"""Checking what a client sent, before any work is queued.

Parses OpenAI-style request bodies (and the gRPC request's values) into ``ParsedRequest``;
every problem raises ``InvalidParameterError`` naming the field and saying how to fix it.
Length checks that need the token count (prompt + max_tokens vs the context) are in
``resolve_max_tokens`` and ``check_prompt_tokens``, called after tokenization.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.errors import ModelNotFoundError
from pdserve.engine.sampling_params import (
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sequence import Priority
from pdserve.engine.config import MAX_DEPTH_CEILING, StructuredLimits
from pdserve.engine.grammar_spec import MAX_SPEC_CHARS, StructuredOutput, choice_spec
from pdserve.engine.structured import check_limits, json_depth
from pdserve.router.errors import InvalidParameterError
from pdserve.router.limits import DEFAULT_MAX_CHOICES

# Beam search reads the top 2 * width logprobs of each step: a technical bound, below the share cap.
BEAM_WIDTH_LIMIT = MAX_LOGPROBS // 2
from pdserve.router.tools import ToolRequest, check_message, parse_tools, tool_grammar

MAX_TEMPERATURE = 2.0
MAX_REQUEST_ID_CHARS = 128
# Prompt text longer than max_model_len * this is refused before tokenizing: real text averages
# 3-5 characters per token, and even long runs of spaces or symbols seldom merge past 16-32.
MAX_CHARS_PER_TOKEN = 32
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Messages in one chat (chat completions, /tokenize), as OpenAI's API: checking, rendering and
# tokenizing tens of thousands of them would hold the router's event loop for a second.
MAX_CHAT_MESSAGES = 2048
_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,%d}$" % MAX_REQUEST_ID_CHARS)
_PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}
# Fields we accept only at their "off" value: (name, allowed values, what to do instead).
_UNSUPPORTED = (
    ("suffix", (None, ""), "suffix (insertion) is not supported"),
    ("functions", (None, []), "the legacy 'functions' are not supported; send them as 'tools'"),
    ("function_call", (None, "none"), "the legacy 'function_call' is not supported; use 'tool_choice'"),
    ("store", (None, False), "storing completions is not supported; leave 'store' out"),
    ("metadata", (None,), "metadata is kept only with stored completions, which are not supported"),
    # vLLM's extension fields pdserve does not serve, each with why and what to do instead
    ("guided_decoding_backend", (None, "auto", "xgrammar"),
     "pdserve's grammar engine is xgrammar; leave 'guided_decoding_backend' out (or \"xgrammar\")"),
    ("guided_whitespace_pattern", (None,), "xgrammar sets the whitespace of JSON outputs itself; leave "
     "'guided_whitespace_pattern' out"),
    ("logits_processors", (None, []), "logits processors named by a request would run code in the server; use "
     "'logit_bias', 'allowed_token_ids' or 'bad_words'"),
    ("prompt_embeds", (None,), "prompts are text or token ids; embeddings are not accepted"),
    ("kv_transfer_params", (None,), "pdserve moves KV between its own prefill and decode pools; a transfer "
     "described by the client is not accepted"),
    ("vllm_xargs", (None,), "no extension here takes extra arguments; leave 'vllm_xargs' out"),
    ("chat_template", (None,), "a chat template sent with a request would run in the server; the model's own "
     "template is used (its variables go in 'chat_template_kwargs')"),
    ("documents", (None,), "the chat template is not given documents; put them in a message"),
    ("mm_processor_kwargs", (None,), "pdserve serves text models; there is no multimodal processor"),
)
# Every request field each endpoint reads; anything else is refused by name (never ignored).
_COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
                            "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "priority",
                            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                            "min_tokens", "logit_bias", "n", "skip_special_tokens", "include_stop_str_in_output",
                            "allowed_token_ids", "truncate_prompt_tokens", "structured_outputs",
                            "return_tokens_as_token_ids", "bad_words", "cache_salt", "prompt_logprobs",
                            "use_beam_search", "length_penalty", "add_special_tokens", "request_id",
                            "return_token_ids",
                            "spaces_between_special_tokens",
                            "response_format", "guided_json", "guided_regex", "guided_choice",
                            "guided_grammar"}
                           | {name for name, _, _ in _UNSUPPORTED})
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "best_of", "echo"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "echo",
                                 "parallel_tool_calls", "add_generation_prompt", "continue_final_message",
                                 "chat_template_kwargs"}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A syntactically valid request; ``max_tokens`` is resolved once the prompt is tokenized."""

    model: str | None
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"  # the field the client set it with (errors name it)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields except max_tokens
    stream: bool = False
    include_usage: bool = False
    priority: Priority = Priority.INTERACTIVE
    tools: ToolRequest | None = None  # chat: the tools and what to do with them (router/tools.py)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's)
    add_generation_prompt: bool = True         # chat: open the assistant's turn
    continue_final_message: bool = False       # chat: continue the last (assistant) message instead
    chat_template_kwargs: dict | None = None   # chat: extra variables for the template
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    n: int = 1            # choices returned for this prompt
    best_of: int = 1      # candidates generated, the n most likely returned (completions, not streamed)
    echo: bool = False    # the prompt's text (chat: the final assistant message) leads each choice
    bad_words: tuple[str, ...] = ()  # vLLM's: tokenized by Serving.prepare into SamplingParams.bad_words
    prompt_logprobs: int | None = None  # vLLM's, as the client asked (echo with logprobs scores the prompt too)
    add_special_tokens: bool | None = None  # vLLM's: None = the endpoint's default (completions yes, chat no)
    request_id: str | None = None   # vLLM's body field: the client's id, as X-Request-Id
    return_token_ids: bool = False  # vLLM's: token ids (and the prompt's) in each choice
    beam_width: int = 0   # vLLM's use_beam_search: this many beams (n); 0: no beam search
    length_penalty: float = 1.0
    # The field that set the grammar (errors name it): Serving.prepare parses the grammar, off the
    # event loop and within structured.compile_timeout_s; parsing here only bounds its size and depth.
    structured_field: str | None = None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, **self.sampling)


def _bad(param: str, message: str) -> InvalidParameterError:
    return InvalidParameterError(message, param=param)


def _opt_int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"'{name}' must be an integer, got {type(value).__name__} {value!r}")
    if lo is not None and value < lo:
        raise _bad(name, f"'{name}' must be at least {lo}, got {value}")
    if hi is not None and value > hi:
        raise _bad(name, f"'{name}' must be at most {hi}, got {value}")
    return value


def _opt_number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"'{name}' must be a finite number, got {type(value).__name__} {_clip(repr(value))}")
    try:
        number = float(value)  # an integer past 1.8e308 overflows
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _bad(name, f"'{name}' must be a finite number, got {_clip(repr(value))}")
    return number


def _opt_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise _bad(name, f"'{name}' must be true or false, got {value!r}")


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise _bad(name, f"'{name}' must be a list of integer token ids")
    if any(t < 0 for t in value):
        raise _bad(name, f"'{name}' must hold non-negative token ids")
    return value


MAX_ECHOED_CHARS = 64  # of a client's string quoted back in an error message
_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object",
               list: "a list"}


def _clip(text: str) -> str:
    """``text`` as an error message quotes it: its first ``MAX_ECHOED_CHARS`` characters."""
    if len(text) <= MAX_ECHOED_CHARS:
        return text
    return f"{text[:MAX_ECHOED_CHARS]}... ({len(text)} characters)"


def _is_allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    """``value`` is one of ``allowed`` with the same type: ``True`` is not ``1``, ``0`` is not ``False``."""
    return any(value is a if a is None else type(value) is type(a) and value == a for a in allowed)


def check_model(requested: str | None, served: str) -> None:
    """Raise ``ModelNotFoundError`` unless ``requested`` is empty or the served model's name."""
    if requested and requested != served:
        err = ModelNotFoundError(f"the model '{_clip(requested)}' does not exist here; this server serves '{served}'")
        err.param = "model"  # type: ignore[attr-defined]
        raise err


def check_request_id(request_id: str, param: str = "request_id") -> str:
    """A client's own request id: opaque to the server (any printable ASCII, '#' included)."""
    if not _REQUEST_ID_RE.match(request_id):
        raise _bad(param, f"{param} must be 1-{MAX_REQUEST_ID_CHARS} printable ASCII characters "
                          "without spaces")
    return request_id


def parse_priority(value: Any) -> Priority:
    if value is None or (type(value) is int and value == 0):  # vLLM's integer priority, at its default
        return Priority.INTERACTIVE
    if isinstance(value, str) and value.lower() in _PRIORITIES:
        return _PRIORITIES[value.lower()]
    raise _bad("priority", f"'priority' must be one of {sorted(_PRIORITIES)} (or 0, vLLM's default), got {value!r}")


def parse_sampling(body: dict, *, chat: bool) -> dict[str, Any]:
    """The sampling fields shared by both endpoints (plus our extensions top_k, ignore_eos, ...)."""
    out: dict[str, Any] = {}
    temperature = _opt_number(body, "temperature")
    if temperature is not None:
        if not (temperature == 0.0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
            raise _bad("temperature", f"'temperature' must be between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}, "
                                      f"or 0 (greedy), got {temperature}")
        out["temperature"] = temperature
    top_p = _opt_number(body, "top_p")
    if top_p is not None:
        if not MIN_TOP_P <= top_p <= 1.0:
            raise _bad("top_p", f"'top_p' must be greater than 0 (at least {MIN_TOP_P}) and at most 1, "
                                f"got {top_p}")
        out["top_p"] = top_p
    top_k = _opt_int(body, "top_k", lo=0)
    if top_k is not None:
        out["top_k"] = top_k
    seed = _opt_int(body, "seed", lo=SEED_MIN, hi=SEED_MAX)
    if seed is not None:
        out["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop", "'stop' must be a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        out["stop"] = tuple(stops)
    if body.get("stop_token_ids") is not None:
        out["stop_token_ids"] = tuple(_token_ids(body["stop_token_ids"], "stop_token_ids"))
    ignore_eos = _opt_bool(body, "ignore_eos")
    if ignore_eos:
        out["ignore_eos"] = True
    for name, lo, hi in (("presence_penalty", -MAX_PENALTY, MAX_PENALTY),
                         ("frequency_penalty", -MAX_PENALTY, MAX_PENALTY), ("min_p", 0.0, 1.0)):
        value = _opt_number(body, name)
        if value is not None:
            if not lo <= value <= hi:
                raise _bad(name, f"'{name}' must be between {lo:g} and {hi:g}, got {value}")
            out[name] = float(value)
    rp = _opt_number(body, "repetition_penalty")
    if rp is not None:
        if not 0.0 < rp <= MAX_REPETITION_PENALTY:
            raise _bad("repetition_penalty", f"'repetition_penalty' must be greater than 0 and at most "
                                             f"{MAX_REPETITION_PENALTY:g} (1 = off), got {rp}")
        out["repetition_penalty"] = float(rp)
    min_tokens = _opt_int(body, "min_tokens", lo=0)
    if min_tokens:
        out["min_tokens"] = min_tokens
    for name, neutral in (("skip_special_tokens", True), ("include_stop_str_in_output", False),
                          ("spaces_between_special_tokens", False)):
        flag = _opt_bool(body, name)
        if flag is not None and flag is not neutral:
            out[name] = flag
    if body.get("allowed_token_ids") is not None:
        allowed = _token_ids(body["allowed_token_ids"], "allowed_token_ids")
        if not allowed:
            raise _bad("allowed_token_ids", "'allowed_token_ids' is empty: no token could be chosen")
        out["allowed_token_ids"] = tuple(allowed)
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
            raise _bad("cache_salt", f"'cache_salt' must be a string of 1-{MAX_CACHE_SALT_CHARS} characters")
        out["cache_salt"] = salt
    bias = body.get("logit_bias")
    if bias is not None:
        out["logit_bias"] = parse_logit_bias(bias)
    structured = parse_structured(body)
    if structured is not None:
        if out.get("ignore_eos") or out.get("min_tokens"):
            name = "ignore_eos" if out.get("ignore_eos") else "min_tokens"
            raise _bad(name, f"'{name}' cannot be combined with a structured output: the grammar decides "
                             "where the output ends")
        out["structured"] = structured
    if chat:
        wants = _opt_bool(body, "logprobs")
        top = _opt_int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
        if top is not None and not wants:
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        if wants:
            out["logprobs"] = top or 0
    else:
        logprobs = _opt_int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
        if logprobs is not None:
            out["logprobs"] = logprobs
    prompt_lp = _opt_int(body, "prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
    if prompt_lp is not None:
        out["prompt_logprobs"] = prompt_lp
    return out


def parse_bad_words(body: dict) -> tuple[str, ...]:
    """vLLM's ``bad_words``: words (strings) the output must not contain; tokenized later."""
    value = body.get("bad_words")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(w, str) and w.strip() for w in value):
        raise _bad("bad_words", "'bad_words' must be a list of non-blank strings")
    if len(value) > MAX_BAD_WORDS:
        raise _bad("bad_words", f"'bad_words' may hold at most {MAX_BAD_WORDS} words, got {len(value)}")
    for word in value:
        if len(word) > MAX_STOP_STRING_CHARS:
            raise _bad("bad_words", f"each of 'bad_words' may be at most {MAX_STOP_STRING_CHARS} characters")
    return tuple(value)


def parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object from token ids (as strings, or integers) to -100..100."""
    if not isinstance(value, dict):
        raise _bad("logit_bias", "'logit_bias' must be an object from token ids to biases (-100 to 100)")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise _bad("logit_bias", f"'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}")
    pairs = []
    for key, bias in value.items():
        tok = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isdigit() and len(key) <= 12:
            tok = int(key)
        if tok is None:
            raise _bad("logit_bias", f"'logit_bias' keys must be token ids, got {_clip(repr(key))}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"'logit_bias' values must be numbers between {-MAX_LOGIT_BIAS:g} and "
                                     f"{MAX_LOGIT_BIAS:g}, got {_clip(repr(bias))} for token {tok}")
        pairs.append((tok, float(bias)))
    return tuple(sorted(pairs))


def check_token_fields(params: SamplingParams, vocab_size: int) -> None:
    """Token ids a request names in its sampling fields must be in the vocabulary."""
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("allowed_token_ids", params.allowed_token_ids),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise _bad(name, f"{name} names token id {bad}, outside the vocabulary [0, {vocab_size})")


_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


_STRUCTURED_OUTPUTS_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                            "grammar": "guided_grammar"}


def _from_structured_outputs(body: dict) -> dict:
    """vLLM's newer ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar`` or
    ``json_object``), as the ``guided_*`` field it stands for."""
    so = body.get("structured_outputs")
    if so is None:
        return body
    if not isinstance(so, dict):
        raise _bad("structured_outputs", "'structured_outputs' must be an object such as {\"json\": {...}}")
    set_keys = [k for k, v in so.items() if v is not None and v is not False]
    unknown = sorted(set(so) - set(_STRUCTURED_OUTPUTS_KEYS) - {"json_object"})
    if unknown:
        raise _bad("structured_outputs", f"unknown field '{_clip(str(unknown[0]))}' in 'structured_outputs'; "
                                         f"it takes one of: json, regex, choice, grammar, json_object")
    if len(set_keys) != 1:
        raise _bad("structured_outputs", "'structured_outputs' must set exactly one of: json, regex, choice, "
                                         "grammar, json_object")
    key = set_keys[0]
    if key == "json_object":
        if so[key] is not True:
            raise _bad("structured_outputs", "'structured_outputs.json_object' must be true")
        return {**body, "structured_outputs": None, "response_format": {"type": "json_object"}}
    return {**body, "structured_outputs": None, _STRUCTURED_OUTPUTS_KEYS[key]: so[key]}


def parse_structured(body: dict) -> StructuredOutput | None:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) or one of vLLM's
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (EBNF), checked
    by compiling it; None when the output is free text."""
    if body.get("structured_outputs") is not None and any(body.get(n) is not None for n in ("response_format", *_GUIDED)):
        raise _bad("structured_outputs", "'structured_outputs' and another structured output field both constrain "
                                         "the output; send one of them")
    body = _from_structured_outputs(body)
    given = [name for name in ("response_format", *_GUIDED) if body.get(name) is not None]
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise _bad("response_format", "'response_format' must be {\"type\": \"text\"}, {\"type\": "
                                          "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                                          "{\"name\": ..., \"schema\": {...}}}")
        if fmt["type"] == "text":
            given.remove("response_format")
    if len(given) > 1:
        raise _bad(given[1], f"'{given[0]}' and '{given[1]}' both constrain the output; send one of them")
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        extra = sorted(set(value) - {"type", "json_schema"})
        if extra:
            raise _bad("response_format", f"unknown field '{_clip(extra[0])}' in 'response_format'")
        if value["type"] == "json_object":
            s = StructuredOutput("json_object")
        else:
            js = value.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise _bad("response_format", "a json_schema response_format needs 'json_schema': "
                                              "{\"name\": ..., \"schema\": {...}}, with the schema an object")
            unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
            if unknown:
                raise _bad("response_format", f"unknown field '{_clip(unknown[0])}' in 'response_format.json_schema'")
            if js.get("strict") is not None and not isinstance(js["strict"], bool):
                raise _bad("response_format", "'response_format.json_schema.strict' must be true or false")
            s = StructuredOutput("json_schema", _json_text(js["schema"], "response_format"))
    elif name == "guided_json":
        if isinstance(value, str):
            if len(value) > MAX_SPEC_CHARS:
                raise _bad(name, f"'guided_json' may be at most {MAX_SPEC_CHARS} characters")
            if json_depth(value) > MAX_DEPTH_CEILING:   # before json.loads, which would recurse that deep
                raise _bad(name, f"'guided_json' nests more than {MAX_DEPTH_CEILING} levels of JSON, more than any "
                                 "server compiles (structured.max_depth)")
            try:
                value = json.loads(value)
            except ValueError:
                raise _bad(name, "'guided_json' must be a JSON schema (an object, or its JSON text)") from None
        if not isinstance(value, dict):
            raise _bad(name, "'guided_json' must be a JSON schema (an object, or its JSON text)")
        s = StructuredOutput("json_schema", _json_text(value, name))
    elif name == "guided_choice":
        try:
            s = StructuredOutput("choice", choice_spec(value))
        except InvalidRequestError as exc:
            raise _bad(name, str(exc)) from None
    else:
        if not isinstance(value, str) or not value:
            raise _bad(name, f"'{name}' must be a non-empty string")
        s = _structured(name, _GUIDED[name], value)
    try:
        check_limits(s, _CEILING)   # the configured limits and the parse: Serving.prepare
    except InvalidRequestError as exc:
        raise _bad(name, str(exc)) from None
    return s


_CEILING = StructuredLimits(max_depth=MAX_DEPTH_CEILING)


def structured_field(body: dict) -> str | None:
    """The field of ``body`` that sets its structured output (``parse_structured`` checked that
    there is at most one)."""
    if body.get("structured_outputs") is not None:
        return "structured_outputs"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") != "text":
        return "response_format"
    return next((name for name in _GUIDED if body.get(name) is not None), None)



def _json_text(schema: dict, name: str) -> str:
    return _structured(name, "json_schema", json.dumps(schema, separators=(",", ":"))).spec


def _structured(name: str, kind: str, spec: str) -> StructuredOutput:
    try:
        return StructuredOutput(kind, spec)
    except InvalidRequestError as exc:
        raise _bad(name, str(exc)) from None


def check_choices(count: int, max_choices: int, param: str, what: str) -> None:
    """``count`` sequences of one request (``what`` says how they add up) against the server's
    ``router.max_choices_per_request``: 400 naming the field and the setting above it."""
    if count > max_choices:
        raise InvalidParameterError(
            f"{what} is {count} sequences, more than the {max_choices} one request may run on this server "
            "(router.max_choices_per_request); ask for fewer or split the request",
            param=param, code="too_many_choices")


def _choice_count(body: dict, name: str, max_choices: int) -> int | None:
    value = _opt_int(body, name, lo=1)
    if value is not None:
        check_choices(value, max_choices, name, f"'{name}'")
    return value


def _common(body: Any, *, chat: bool, max_choices: int = DEFAULT_MAX_CHOICES) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidParameterError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"'model' must be a string, got {model!r}")
    known = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    unknown = sorted(str(k) for k in body if k not in known)
    if unknown:
        other = "/v1/completions" if chat else "/v1/chat/completions"
        where = f" (it belongs to {other})" if unknown[0] in (_COMPLETION_FIELDS | _CHAT_FIELDS) else ""
        raise _bad(unknown[0], f"unknown parameter '{_clip(unknown[0])}'{where}: pdserve does not implement it and "
                               f"will not ignore it silently; this endpoint accepts: {', '.join(sorted(known))}")
    for name, allowed, hint in _UNSUPPORTED:
        value = body.get(name)
        if not _is_allowed(value, allowed):
            kinds = {type(a) for a in allowed if a is not None}
            if kinds and type(value) not in kinds:  # e.g. n: true, which Python would take for 1
                kind = "a number" if kinds == {int, float} else " or ".join(sorted(_KIND_NAMES[k] for k in kinds))
                raise _bad(name, f"'{name}' must be {kind}, got {type(value).__name__} {_clip(repr(value))}")
            raise _bad(name, hint)
    stream = _opt_bool(body, "stream") or False
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(options, dict):
            raise _bad("stream_options", "'stream_options' must be an object like {\"include_usage\": true}")
        include_usage = bool(_opt_bool(options, "include_usage"))
    n = _choice_count(body, "n", max_choices) or 1
    best_of = _choice_count(body, "best_of", max_choices) if not chat else None
    if best_of is not None and best_of < n:
        raise _bad("best_of", f"'best_of' ({best_of}) must be at least 'n' ({n})")
    if best_of is not None and best_of > 1 and stream:
        raise _bad("best_of", "'best_of' cannot be streamed: the best choices are known only at the end; "
                              "leave 'stream' out, or use 'n'")
    echo = bool(_opt_bool(body, "echo"))
    request_id = body.get("request_id")
    if request_id is not None:
        if not isinstance(request_id, str):
            raise _bad("request_id", "'request_id' must be a string")
        check_request_id(request_id)
    truncate = _opt_int(body, "truncate_prompt_tokens", lo=1)
    tokens_as_ids = bool(_opt_bool(body, "return_tokens_as_token_ids"))
    sampling = parse_sampling(body, chat=chat)
    asked_prompt_lp = sampling.get("prompt_logprobs")
    if asked_prompt_lp is not None and stream:
        raise _bad("prompt_logprobs", "'prompt_logprobs' cannot be streamed (as in vLLM); leave 'stream' out")
    if echo and not chat and sampling.get("logprobs") is not None:
        if stream:
            raise _bad("echo", "'echo' with 'logprobs' scores the prompt, which cannot be streamed; leave "
                               "'stream' out")
        # the echoed prompt's tokens get their logprobs too (OpenAI's legacy completions)
        sampling["prompt_logprobs"] = max(sampling["logprobs"], sampling.get("prompt_logprobs") or 0)
    max_tokens = _opt_int(body, "max_tokens", lo=0 if echo and not chat else 1)
    beam_width, length_penalty = _parse_beam(body, sampling, n=n, best_of=best_of, stream=stream, echo=echo)
    if max_tokens == 0 and stream:
        raise _bad("max_tokens", "'max_tokens' 0 (echo the prompt, generate nothing) cannot be streamed")
    max_tokens_field = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens, max_tokens_field = _opt_int(body, "max_completion_tokens", lo=1), "max_completion_tokens"
    return dict(model=model or None, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                max_tokens_field=max_tokens_field, n=n, best_of=best_of or n, echo=echo,
                truncate_prompt_tokens=truncate, tokens_as_ids=tokens_as_ids, bad_words=parse_bad_words(body),
                prompt_logprobs=asked_prompt_lp, sampling=sampling, beam_width=beam_width,
                length_penalty=length_penalty, add_special_tokens=_opt_bool(body, "add_special_tokens"),
                request_id=request_id, return_token_ids=bool(_opt_bool(body, "return_token_ids")), priority=parse_priority(body.get("priority")))


# What beam search reads besides n and max_tokens (vLLM's BeamSearchParams); any other sampling
# field is refused with it rather than ignored.
_BEAM_SAMPLING = frozenset({"ignore_eos", "skip_special_tokens", "cache_salt", "temperature"})


def _parse_beam(body: dict, sampling: dict, *, n: int, best_of: int | None, stream: bool,
                echo: bool) -> tuple[int, float]:
    """vLLM's ``use_beam_search`` (``n`` beams) and ``length_penalty``: (beam width or 0, penalty)."""
    use = bool(_opt_bool(body, "use_beam_search"))
    penalty = _opt_number(body, "length_penalty")
    if not use:
        if penalty is not None and penalty != 1.0:
            raise _bad("length_penalty", "'length_penalty' ranks beams: it needs 'use_beam_search': true")
        return 0, 1.0
    if penalty is not None and not -10.0 <= penalty <= 10.0:
        raise _bad("length_penalty", f"'length_penalty' must be between -10 and 10, got {penalty}")
    if n > BEAM_WIDTH_LIMIT:
        raise _bad("n", f"beam search keeps 'n' beams, at most {BEAM_WIDTH_LIMIT} (each step reads the top "
                        f"2n logprobs, at most {MAX_LOGPROBS}), got {n}")
    for name, bad in (("stream", stream), ("echo", echo), ("best_of", best_of is not None and best_of != n)):
        if bad:
            raise _bad(name, f"'{name}' cannot be combined with 'use_beam_search': the beams are known only at "
                             "the end, and there are 'n' of them")
    if sampling.get("temperature", 0.0) != 0.0:
        raise _bad("temperature", "beam search ranks the most likely continuations; leave 'temperature' out or 0")
    other = sorted(set(sampling) - _BEAM_SAMPLING)
    if other:
        raise _bad(other[0], f"'{other[0]}' cannot be combined with 'use_beam_search' (beam search reads 'n', "
                             "'max_tokens', 'length_penalty' and 'ignore_eos'); leave it out")
    return n, 1.0 if penalty is None else penalty


def parse_completion_body(body: Any) -> ParsedRequest:
    """Validate a ``/v1/completions`` body with one prompt (a string or a list of token ids)."""
    requests = parse_completion_bodies(body)
    if len(requests) > 1:
        raise _bad("prompt", f"{len(requests)} prompts given where one is expected")
    return requests[0]


def parse_completion_bodies(body: Any, *, max_choices: int = DEFAULT_MAX_CHOICES) -> list[ParsedRequest]:
    """Validate a ``/v1/completions`` body: one prompt (a string or a list of token ids) or a list
    of them, each answered by its own choices (``n`` each, in order); ``max_choices`` is
    ``router.max_choices_per_request``."""
    common = _common(body, chat=False, max_choices=max_choices)
    common["structured_field"] = structured_field(body)
    if "prompt" not in body:
        raise _bad("prompt", "'prompt' is required: a string, a list of token ids, or a list of either")
    prompt = body["prompt"]
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    check_choices(len(prompts) * common["best_of"], max_choices, "prompt",
                  f"{len(prompts)} prompts x {common['best_of']} choices")
    return [_one_prompt(p, common, f"prompt[{i}]" if len(prompts) > 1 else "prompt") for i, p in enumerate(prompts)]


def _one_prompt(prompt: Any, common: dict, where: str) -> ParsedRequest:
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", f"'{where}' is empty; send at least one character")
        return ParsedRequest(prompt_text=prompt, **common)
    if isinstance(prompt, list):
        if not prompt:
            raise _bad("prompt", f"'{where}' is an empty list; send at least one token id")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise _bad("prompt", f"'{where}' must be a string or a list of integer token ids, not a mixed list")
        return ParsedRequest(prompt_token_ids=_token_ids(prompt, "prompt"), **common)
    raise _bad("prompt", f"'{where}' must be a string or a list of token ids, got {type(prompt).__name__}")


def check_message_count(messages: list) -> None:
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidParameterError(f"'messages' has {len(messages)} messages; one request may send at most "
                                    f"{MAX_CHAT_MESSAGES}: shorten the conversation", param="messages",
                                    code="too_many_messages")


def _message(i: int, msg: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise _bad("messages", f"{where} must be an object with 'role' and 'content'")
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise _bad("messages", f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
    unknown = sorted(set(msg) - {"role", "content", "name", "tool_calls", "tool_call_id"})
    if unknown:
        raise _bad("messages", f"{where} has an unknown field '{_clip(str(unknown[0]))}'")
    extra = check_message(where, msg)
    if msg.get("name") is not None:
        if not isinstance(msg["name"], str):
            raise _bad("messages", f"{where}.name must be a string")
        extra["name"] = msg["name"]   # the template may show it (a participant's name)
    content = msg.get("content")
    if content is None and extra.get("tool_calls"):
        return {"role": role, "content": None, **extra}
    if isinstance(content, str):
        return {"role": role, "content": content, **extra}
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad("messages", f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}}; "
                                       "only text content is supported")
            texts.append(part["text"])
        return {"role": role, "content": "".join(texts), **extra}
    raise _bad("messages", f"{where}.content must be a string or a list of text parts")


def parse_chat_body(body: Any, *, max_choices: int = DEFAULT_MAX_CHOICES) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body (``max_choices``: ``router.max_choices_per_request``)."""
    common = _common(body, chat=True, max_choices=max_choices)
    common["structured_field"] = structured_field(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    check_message_count(messages)
    gen = _opt_bool(body, "add_generation_prompt")
    cont = bool(_opt_bool(body, "continue_final_message"))
    if cont and gen:
        raise _bad("continue_final_message", "'continue_final_message' continues the last message, so "
                                             "'add_generation_prompt' must be false with it")
    if cont and (not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant"):
        raise _bad("continue_final_message", "'continue_final_message' needs the last message to be the assistant's")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise _bad("chat_template_kwargs", "'chat_template_kwargs' must be an object of template variables")
        reserved = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt", "continue_final_message",
                                         "tokenize", "documents", "chat_template"})
        if reserved:
            raise _bad("chat_template_kwargs", f"'chat_template_kwargs' may not set '{reserved[0]}'; use the "
                                               "request field of that name")
    if common["echo"] and (not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant"):
        raise _bad("echo", "chat 'echo' repeats the final message when it is the assistant's (the reply continues "
                           "it, e.g. with 'continue_final_message'); the last message here is not")
    common.update(add_generation_prompt=not cont if gen is None else gen, continue_final_message=cont,
                  chat_template_kwargs=kwargs or None)
    tools = parse_tools(body)
    grammar = tool_grammar(tools) if tools is not None else None
    if tools is not None and common["echo"]:
        raise _bad("echo", "chat 'echo' cannot be combined with 'tools'")
    if grammar is not None:
        if common["beam_width"]:
            raise _bad("tool_choice", f"tool_choice '{tools.choice}' cannot be combined with 'use_beam_search'")
        if common["sampling"].get("structured") is not None:
            raise _bad("tool_choice", f"tool_choice '{tools.choice}' and a structured output both constrain the "
                                      "reply; send one of them (or tool_choice \"none\")")
        if common["sampling"].get("ignore_eos") or common["sampling"].get("min_tokens"):
            raise _bad("tool_choice", "tools cannot be combined with ignore_eos or min_tokens")
        common["sampling"]["structured"] = grammar
        common["structured_field"] = "tools"
    return ParsedRequest(messages=[_message(i, m) for i, m in enumerate(messages)], tools=tools, **common)


def check_prompt_tokens(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """The prompt must be non-empty, inside the vocabulary, and leave room for one new token."""
    if not token_ids:
        raise _bad("prompt", "the prompt is empty after tokenization; send some text")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _bad("prompt", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise InvalidParameterError(
            f"the prompt has {len(token_ids)} tokens but this model's context length is {max_model_len}; "
            f"shorten the prompt to at most {max_model_len - 1} tokens",
            param="prompt", code="context_length_exceeded")


def max_prompt_chars(max_model_len: int) -> int:
    """The longest prompt text worth tokenizing: ``MAX_CHARS_PER_TOKEN`` per token of context."""
    return max_model_len * MAX_CHARS_PER_TOKEN


def check_prompt_chars(parsed: ParsedRequest, max_model_len: int) -> None:
    """Refuse, before tokenizing, prompt text too long to fit the context even at the most
    characters a token can plausibly hold (tokenizing megabytes takes seconds of the router)."""
    bound = max_prompt_chars(max_model_len)
    if parsed.prompt_text is not None:
        chars, param = len(parsed.prompt_text), "prompt"
    elif parsed.messages is not None:
        chars, param = sum(len(m.get("content") or "") for m in parsed.messages), "messages"
    else:
        return
    if chars > bound:
        raise InvalidParameterError(
            f"the {param} has {chars} characters; this model's context length is {max_model_len} tokens, "
            f"so at most {bound} characters are accepted ({MAX_CHARS_PER_TOKEN} per token); "
            "shorten it", param=param, code="context_length_exceeded")


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, default: int | None,
                       *, limit: int | None = None, field_name: str = "max_tokens") -> int:
    """``max_tokens`` checked against the server's ``limit`` and the room the context leaves;
    when unset: ``default`` (None means all the room), capped by ``limit`` and the room."""
    room = max_model_len - prompt_len
    if requested is None:
        caps = [c for c in (default, limit) if c is not None]
        return min([room, *caps])
    if limit is not None and requested > limit:
        raise InvalidParameterError(
            f"'{field_name}' is {requested}, above this server's limit of {limit} "
            f"(router.max_tokens_limit); ask for at most {limit} tokens",
            param=field_name, code="max_tokens_exceeded")
    if requested > room:
        raise InvalidParameterError(
            f"this model's context length is {max_model_len} tokens, but the prompt ({prompt_len} tokens) "
            f"plus {field_name} ({requested}) needs {prompt_len + requested}; "
            f"lower {field_name} to at most {room} or shorten the prompt",
            param=field_name, code="context_length_exceeded")
    return requested


def parse_generate_fields(model: str, prompt_text: str | None, prompt_token_ids: list[int] | None,
                          fields: dict[str, Any], priority: Priority, *,
                          max_choices: int = DEFAULT_MAX_CHOICES) -> ParsedRequest:
    """Validate the gRPC ``Generate`` request's values (``fields``: the set sampling fields by name;
    ``max_choices``: ``router.max_choices_per_request``)."""
    if prompt_text is None and prompt_token_ids is None:
        raise _bad("prompt", "set the prompt: either 'text' or 'token_ids'")
    if prompt_text is not None and not prompt_text:
        raise _bad("prompt", "'text' is empty; send at least one character")
    if prompt_token_ids is not None and not prompt_token_ids:
        raise _bad("prompt", "'token_ids' is empty; send at least one token id")
    max_tokens = _opt_int(fields, "max_tokens", lo=1)
    n = _choice_count(fields, "n", max_choices) or 1
    best_of = _choice_count(fields, "best_of", max_choices) or n
    if best_of < n:
        raise _bad("best_of", f"'best_of' ({best_of}) must be at least 'n' ({n})")
    return ParsedRequest(model=model or None, prompt_text=prompt_text, prompt_token_ids=prompt_token_ids,
                         max_tokens=max_tokens, sampling=parse_sampling(fields, chat=False), priority=priority,
                         structured_field=structured_field(fields),
                         n=n, best_of=best_of, bad_words=parse_bad_words(fields), echo=bool(fields.get("echo")))


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages rendered with the chat template."""

    model: str | None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                              "return_token_strs"})


def _only(body: Any, known: frozenset[str], what: str) -> dict:
    if not isinstance(body, dict):
        raise InvalidParameterError("the request body must be a JSON object")
    unknown = sorted(str(k) for k in body if k not in known)
    if unknown:
        raise _bad(unknown[0], f"unknown parameter '{_clip(unknown[0])}' for {what}; it accepts: "
                               f"{', '.join(sorted(known))}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"'model' must be a string, got {model!r}")
    return body


def parse_tokenize_body(body: Any) -> TokenizeRequest:
    body = _only(body, _TOKENIZE_FIELDS, "/tokenize")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise _bad("prompt", "send either 'prompt' (a string) or 'messages' (a chat), not both or neither")
    if prompt is not None and not isinstance(prompt, str):
        raise _bad("prompt", "'prompt' must be a string")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
        check_message_count(messages)
        messages = [_message(i, m) for i, m in enumerate(messages)]
    flags = {name: _opt_bool(body, name) for name in ("add_special_tokens", "add_generation_prompt",
                                                      "return_token_strs")}
    return TokenizeRequest(body.get("model") or None, prompt, messages,
                           add_special_tokens=flags["add_special_tokens"] if flags["add_special_tokens"] is not None
                           else messages is None,   # a chat template writes its own special tokens
                           add_generation_prompt=flags["add_generation_prompt"] is not False,
                           return_token_strs=bool(flags["return_token_strs"]))


def parse_detokenize_body(body: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """``POST /detokenize``: (model, token ids), every id inside the vocabulary."""
    body = _only(body, frozenset({"model", "tokens"}), "/detokenize")
    if "tokens" not in body:
        raise _bad("tokens", "'tokens' is required: a list of token ids")
    tokens = _token_ids(body["tokens"], "tokens")
    bad = next((t for t in tokens if t >= vocab_size), None)
    if bad is not None:
        raise _bad("tokens", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return body.get("model") or None, tokens
