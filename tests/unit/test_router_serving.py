"""The shared request pipeline over a scripted in-memory backend that knows nothing of text."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.contract import RequestPhase
from pdserve.engine.errors import DeadlineExceededError
from pdserve.router.backend import Finished, ModelInfo, TokenDelta
from pdserve.router.serving import Chunk, Serving
from pdserve.router.validation import parse_completion_body


class ScriptedBackend:
    """Emits the token ids of ``script`` one per delta (slowly if asked), then Finished("length")."""

    def __init__(self, tokenizer_dir: str, script: list[int], delay_s: float = 0.0) -> None:
        from pdserve.engine.tokenizer import load_tokenizer

        self._info = ModelInfo("m", 512, len(load_tokenizer(tokenizer_dir)), (1,), tokenizer_dir)
        self.script = script
        self.delay_s = delay_s
        self.aborted: list[str] = []
        self.started: list[str] = []  # the server's request ids, in order
        self.closed = 0

    def model_info(self) -> ModelInfo:
        return self._info

    async def generate(self, req):
        self.started.append(req.request_id)
        try:
            for tok in self.script[: req.params.max_tokens]:
                if req.request_id in self.aborted:
                    yield Finished("abort", RequestPhase(output_tokens=0))
                    return
                await asyncio.sleep(self.delay_s)
                yield TokenDelta([tok])
            yield Finished("length", RequestPhase(cached_prompt_tokens=3, total_s=0.1))
        finally:
            self.closed += 1

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> bool:
        return True


def run(serving: Serving, body: dict, deadline: float | None = None) -> list:
    async def go() -> list:
        prepared = await serving.prepare(parse_completion_body(body), "r1", default_max_tokens=16)
        async with serving.stream(prepared, api="test", deadline=deadline) as events:
            return [ev async for ev in events]

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from pdserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


def test_router_applies_stop_strings_and_aborts_the_backend(tiny_model, tokenizer) -> None:
    script = tokenizer(" one two three four five", add_special_tokens=False)["input_ids"]
    backend = ScriptedBackend(str(tiny_model), script)
    serving = Serving(backend, tokenizer=tokenizer)
    events = run(serving, {"prompt": "count:", "stop": "three", "max_tokens": 10})
    text = "".join(e.text for e in events if isinstance(e, Chunk))
    final = events[-1]
    assert text == " one two " and isinstance(final, Finished) and final.finish_reason == "stop"
    assert backend.aborted == backend.started and backend.closed == 1
    assert final.phase.output_tokens == sum(len(e.token_ids) for e in events if isinstance(e, Chunk))
    assert serving.admission.in_flight == 0


def test_natural_finish_flushes_text_and_reports_usage(tiny_model, tokenizer) -> None:
    script = tokenizer(" héllo wörld", add_special_tokens=False)["input_ids"]
    serving = Serving(ScriptedBackend(str(tiny_model), script), tokenizer=tokenizer)
    events = run(serving, {"prompt": "say:", "max_tokens": len(script)})
    assert "".join(e.text for e in events if isinstance(e, Chunk)) == " héllo wörld"
    final = events[-1]
    ph = final.phase
    assert (final.finish_reason, ph.cached_prompt_tokens, ph.output_tokens) == ("length", 3, len(script))
    assert final.phase.kv_bytes == 0 and final.phase.finish_reason == "length"


def test_deadline_aborts_the_backend(tiny_model, tokenizer) -> None:
    import time

    backend = ScriptedBackend(str(tiny_model), list(range(10, 40)), delay_s=0.05)
    serving = Serving(backend, tokenizer=tokenizer)
    with pytest.raises(DeadlineExceededError):
        run(serving, {"prompt": "x", "max_tokens": 30}, deadline=time.monotonic() + 0.2)
    assert backend.aborted == backend.started and backend.closed == 1
    assert serving.admission.in_flight == 0


class Recorder:
    def __init__(self) -> None:
        self.records = []

    def request_ended(self, record) -> None:
        self.records.append(record)


class Raising:
    def request_ended(self, record) -> None:
        raise RuntimeError("observer bug")


def test_every_request_ends_as_one_record_for_the_observers(tiny_model, tokenizer) -> None:
    """Completed, stopped, timed-out and cancelled requests each reach every observer once, with
    the phase the client's usage came from; an observer that raises harms neither the request nor
    the observers after it."""
    import time

    from pdserve.engine.contract import RequestRecord

    script = tokenizer(" one two three four five", add_special_tokens=False)["input_ids"]
    backend = ScriptedBackend(str(tiny_model), script, delay_s=0.02)
    rec = Recorder()
    serving = Serving(backend, tokenizer=tokenizer, observers=[Raising(), rec])
    events = run(serving, {"prompt": "count:", "stop": "three", "max_tokens": 10})
    run(serving, {"prompt": "count:", "max_tokens": 2})
    with pytest.raises(DeadlineExceededError):
        run(serving, {"prompt": "x", "max_tokens": 5}, deadline=time.monotonic() + 0.05)

    async def cancelled() -> None:
        prepared = await serving.prepare(parse_completion_body({"prompt": "c", "max_tokens": 5}), "mine", default_max_tokens=16)
        async with serving.stream(prepared, api="test") as stream:
            await anext(stream)  # the client reads one chunk and leaves

    asyncio.run(cancelled())
    assert [(r.api, r.outcome, r.finish_reason) for r in rec.records] == [
        ("test", "stop", "stop"), ("test", "length", "length"), ("test", "timeout_error", "abort"),
        ("test", "cancelled", "abort")]
    stopped = rec.records[0]
    assert isinstance(stopped, RequestRecord) and stopped.phase == events[-1].phase
    assert stopped.phase.output_tokens == 3 and stopped.phase.prompt_tokens > 0 and stopped.error is None
    assert rec.records[2].error and "deadline" in rec.records[2].error
    assert rec.records[3].client_request_id == "mine" and len(rec.records[1].itl_s) == 1
    # The router's own /metrics text is the first observer: four requests by outcome.
    text = serving.metrics.render()
    for outcome in ("stop", "length", "timeout_error", "cancelled"):
        assert f'pdserve_router_requests_finished_total{{model="m",api="test",outcome="{outcome}"}} 1' in text
    assert 'pdserve_router_generation_tokens_total{model="m"} 5' in text  # 3 (stop) + 2 (length); not the rest
    # every family has HELP and TYPE, every sample the model label; totals are counters
    families = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE")}
    helped = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP")}
    assert set(families) == helped and families["pdserve_router_requests_rejected_total"] == "counter"
    assert all(kind == "counter" for name, kind in families.items() if name.endswith("_total"))
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert samples and all('model="m"' in line for line in samples)
    assert serving.admission.in_flight == 0


def test_a_request_log_entry_reads_back_as_the_record() -> None:
    from pdserve.engine.contract import RequestRecord

    r = RequestRecord("s1", "c1", "grpc", "stop", max_tokens=9, time=1.5,
                      phase=RequestPhase(prompt_tokens=4, output_tokens=2, total_s=0.25, finish_reason="stop"))
    assert RequestRecord.from_dict(r.to_dict()) == r
    assert r.to_dict()["finish_reason"] == "stop" and "itl_s" not in r.to_dict()
    refused = RequestRecord("s2", "c2", "http", "overloaded", error="full")
    assert RequestRecord.from_dict(refused.to_dict()) == refused


class BeamBackend(ScriptedBackend):
    """Every request is one token (beam search's steps) with logprobs, after ``delay_s``; the
    requests after the first ``hang_after`` answer only an abort (a worker stuck on them)."""

    def __init__(self, tokenizer_dir: str, delay_s: float) -> None:
        super().__init__(tokenizer_dir, [], delay_s)
        self.hang_after = 10**9    # steps answered before the next ones hang
        self.live: set[str] = set()

    async def generate(self, req):
        self.started.append(req.request_id)
        self.live.add(req.request_id)
        try:
            await asyncio.sleep(self.delay_s)
            while len(self.started) > self.hang_after and req.request_id not in self.aborted:
                await asyncio.sleep(0.01)
            if req.request_id in self.aborted:
                yield Finished("abort", RequestPhase(output_tokens=0))
                return
            tok = 10 + len(req.prompt_token_ids) % 7
            yield TokenDelta([tok], [{tok: -0.1, tok + 1: -0.5, tok + 2: -0.9, tok + 3: -1.5}])
            yield Finished("length", RequestPhase(output_tokens=1))
        finally:
            self.live.discard(req.request_id)
            self.closed += 1


@pytest.mark.parametrize("hang_after", [None, 7])
def test_beam_search_ends_at_the_requests_deadline_and_aborts_every_step(tiny_model, tokenizer,
                                                                        hang_after: int | None) -> None:
    """Each step is far shorter than the deadline (or one step hangs): the search still ends at
    the deadline it fixed as it started, with the timeout error, every step request aborted and
    every slot given back."""
    import time

    from pdserve.router.beam_search import beam_search
    from pdserve.router.serving import ServingLimits

    backend = BeamBackend(str(tiny_model), delay_s=0.005)
    if hang_after is not None:
        backend.hang_after = hang_after
    serving = Serving(backend, tokenizer=tokenizer, limits=ServingLimits(request_timeout_s=0.4))

    async def go() -> float:
        prepared = await serving.prepare(parse_completion_body({"prompt": "x", "max_tokens": 400}), "b",
                                         default_max_tokens=16)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await beam_search(serving, prepared, 2, 1.0, eos_token_ids=frozenset(), api="test")
        return time.monotonic() - t0

    took = asyncio.run(go())
    assert 0.35 < took < 1.0, took
    assert len(backend.started) > 4 and not backend.live and backend.closed == len(backend.started)
    assert (serving.admission.in_flight, serving.admission.queued) == (0, 0)


def test_choices_share_one_deadline_and_one_admission_group(tiny_model, tokenizer) -> None:
    """Later choices (they start after the first one's first token) end at the response's
    deadline, not at one of their own; none holds a slot afterwards."""
    import time

    from pdserve.router.choices import ChoiceRequest, fork, run_choices
    from pdserve.router.serving import ServingLimits

    backend = ScriptedBackend(str(tiny_model), list(range(10, 400)), delay_s=0.02)
    serving = Serving(backend, tokenizer=tokenizer, limits=ServingLimits(request_timeout_s=0.5))
    seen_groups: set = set()
    acquire = serving.admission.acquire

    async def spy(group=None):
        seen_groups.add(group)
        await acquire(group)

    serving.admission.acquire = spy

    async def go() -> float:
        prepared = await serving.prepare(parse_completion_body({"prompt": "x", "max_tokens": 300}), "c",
                                         default_max_tokens=16)
        choices = [ChoiceRequest(j, 0, fork(prepared, j, j)) for j in range(3)]
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            async for _ in run_choices(serving, choices, api="test"):
                pass
        return time.monotonic() - t0

    took = asyncio.run(go())
    assert 0.45 < took < 0.8, took
    assert len(seen_groups) == 1 and len(backend.started) == 3 and backend.closed == 3
    assert sorted(backend.aborted) == sorted(backend.started)
    assert (serving.admission.in_flight, serving.admission.queued) == (0, 0)
