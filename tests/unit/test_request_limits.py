"""Request ids and limits in the router's pure logic: server ids, client-id scoping, the default
deadline, max_tokens_limit, the early prompt-length check and exact attempt matching on abort."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from pdserve.engine.errors import DeadlineExceededError
from pdserve.router.disagg_backend import DisaggBackend
from pdserve.router.errors import DuplicateRequestIdError, InvalidParameterError
from pdserve.router.auth import owner_id
from pdserve.router.serving import Serving, ServingLimits
from pdserve.router.validation import (
    MAX_CHARS_PER_TOKEN,
    check_prompt_chars,
    parse_chat_body,
    parse_completion_body,
    resolve_max_tokens,
)
from test_router_serving import ScriptedBackend


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from pdserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


def make_serving(tiny_model, tokenizer, *, delay_s: float = 0.0, limits: ServingLimits | None = None):
    backend = ScriptedBackend(str(tiny_model), list(range(10, 40)), delay_s=delay_s)
    return backend, Serving(backend, tokenizer=tokenizer, limits=limits)


# ------------------------------------------------------------------ request ids
def test_backend_sees_a_server_id_never_the_clients(tiny_model, tokenizer) -> None:
    backend, serving = make_serving(tiny_model, tokenizer)

    async def go():
        prepared = await serving.prepare(parse_completion_body({"prompt": "x", "max_tokens": 2}), "victim#7",
                                         default_max_tokens=16)
        async with serving.stream(prepared, api="test") as events:
            [ev async for ev in events]
        return prepared

    prepared = asyncio.run(go())
    assert prepared.client_id == "victim#7"
    assert backend.started == [prepared.request_id]
    assert "#" not in prepared.request_id and "victim" not in prepared.request_id


def test_a_live_duplicate_id_is_refused_in_its_scope_only_and_free_again_after(tiny_model, tokenizer) -> None:
    backend, serving = make_serving(tiny_model, tokenizer, delay_s=0.02)
    body = {"prompt": "x", "max_tokens": 3}

    async def go():
        first = await serving.prepare(parse_completion_body(body), "dup", default_max_tokens=16)
        second = await serving.prepare(parse_completion_body(body), "dup", default_max_tokens=16)
        async with serving.stream(first, api="test") as events:
            with pytest.raises(DuplicateRequestIdError) as exc:
                async with serving.stream(second, api="test"):
                    pass
            assert "'dup'" in str(exc.value) and exc.value.param == "request_id"
            assert first.request_id not in str(exc.value)
            assert serving.server_id("dup") == first.request_id
            other_tenant = await serving.prepare(parse_completion_body(body), "dup", default_max_tokens=16)
            async with serving.stream(other_tenant, api="test", scope=owner_id("other")) as ev2:
                [e async for e in ev2]
            [e async for e in events]
        assert serving.admission.in_flight == 0
        async with serving.stream(second, api="test") as events:  # the first one ended: usable again
            return [e async for e in events]

    assert asyncio.run(go())[-1].finish_reason == "length"


# --------------------------------------------------------------------- deadline
def test_request_timeout_is_the_default_deadline_and_a_shorter_client_deadline_wins(tiny_model, tokenizer) -> None:
    backend, serving = make_serving(tiny_model, tokenizer, delay_s=0.05,
                                    limits=ServingLimits(request_timeout_s=0.3))

    async def go(deadline: float | None) -> float:
        prepared = await serving.prepare(parse_completion_body({"prompt": "x", "max_tokens": 30}), "t",
                                         default_max_tokens=16)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError) as exc:
            async with serving.stream(prepared, api="test", deadline=deadline) as events:
                [e async for e in events]
        assert "0.3 s" in str(exc.value)
        return time.monotonic() - t0

    assert 0.25 < asyncio.run(go(None)) < 1.0  # 30 tokens at 50 ms would take 1.5 s
    assert asyncio.run(go(time.monotonic() + 0.1)) < 0.25
    assert backend.aborted == backend.started and serving.admission.in_flight == 0


# ------------------------------------------------------------------- max_tokens
def test_max_tokens_limit_refuses_above_and_caps_the_default() -> None:
    with pytest.raises(InvalidParameterError) as exc:
        resolve_max_tokens(300, 10, 4096, None, limit=256)
    assert exc.value.param == "max_tokens" and "256" in str(exc.value)
    with pytest.raises(InvalidParameterError) as exc:
        resolve_max_tokens(300, 10, 4096, None, limit=256, field_name="max_completion_tokens")
    assert exc.value.param == "max_completion_tokens"
    assert resolve_max_tokens(256, 10, 4096, None, limit=256) == 256
    assert resolve_max_tokens(None, 10, 4096, None, limit=256) == 256     # chat: min(room, limit)
    assert resolve_max_tokens(None, 4000, 4096, None, limit=256) == 96    # room smaller than limit
    assert resolve_max_tokens(None, 10, 4096, 16, limit=256) == 16


def test_chat_names_max_completion_tokens_when_it_was_the_field_used() -> None:
    parsed = parse_chat_body({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5})
    assert (parsed.max_tokens, parsed.max_tokens_field) == (5, "max_completion_tokens")


def test_prompt_text_too_long_for_the_context_is_refused_before_tokenizing() -> None:
    bound = 100 * MAX_CHARS_PER_TOKEN
    check_prompt_chars(parse_completion_body({"prompt": "a" * bound}), 100)
    with pytest.raises(InvalidParameterError) as exc:
        check_prompt_chars(parse_completion_body({"prompt": "a" * (bound + 1)}), 100)
    assert exc.value.param == "prompt" and str(bound) in str(exc.value)
    with pytest.raises(InvalidParameterError) as exc:
        check_prompt_chars(parse_chat_body({"messages": [{"role": "user", "content": "a" * (bound + 1)}]}), 100)
    assert exc.value.param == "messages"


# ------------------------------------------------------------ attempts and abort
class _Actor:
    def __init__(self, log: list, wid: str) -> None:
        self.abort = SimpleNamespace(remote=lambda attempt, **kw: log.append((wid, attempt)))


def test_abort_reaches_exactly_the_request_it_names() -> None:
    log: list = []
    members = {w: SimpleNamespace(view=SimpleNamespace(alive=True), actor=_Actor(log, w)) for w in ("d0", "d1")}
    b = DisaggBackend(SimpleNamespace(), SimpleNamespace(members=members))
    # Two live requests whose ids share a prefix up to '#' (as client ids could before).
    b._active = {"victim#1": ("d0", None), "victim#7#1": ("d1", None)}
    b._attempt_of = {"victim": "victim#1", "victim#7": "victim#7#1"}
    asyncio.run(b.abort("victim"))
    assert log == [("d0", "victim#1")]
    assert b.placement("victim#7") == ("d1", None) and b.placement("nobody") is None


def test_tenant_salts_split_tenants_and_keep_a_tenants_own_salts_apart():
    from pdserve.router.serving import tenant_salt

    a, b = owner_id("key-a"), owner_id("key-b")
    assert tenant_salt(a, None) != tenant_salt(b, None)
    assert tenant_salt(a, "s") != tenant_salt(b, "s")          # B cannot reach A's cache by its salt
    assert tenant_salt(a, "s") != tenant_salt(a, "t") != tenant_salt(a, None)
    assert tenant_salt(a, "s") == tenant_salt(a, "s")
    assert len(tenant_salt(a, "x" * 256)) <= 256


@pytest.mark.parametrize("isolate", [True, False])
def test_tenant_cache_isolation_salts_a_tenants_requests_only_when_on(tiny_model, tokenizer, isolate) -> None:
    from pdserve.router.serving import tenant_salt

    backend, serving = make_serving(tiny_model, tokenizer, limits=ServingLimits(tenant_cache_isolation=isolate))
    salts = []
    generate = backend.generate

    def recording(req):
        salts.append(req.params.cache_salt)
        return generate(req)
    backend.generate = recording
    owner = owner_id("key-a")

    async def go():
        for scope in (owner, ""):   # a tenant's request, then an anonymous one
            prepared = await serving.prepare(parse_completion_body({"prompt": "x", "max_tokens": 1}), "",
                                             default_max_tokens=16)
            async with serving.stream(prepared, api="test", scope=scope) as events:
                [ev async for ev in events]

    asyncio.run(go())
    assert salts == ([tenant_salt(owner, None)] if isolate else [None]) + [None]
