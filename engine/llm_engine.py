"""The engine: one step loop over scheduler, model runner and sampler.

Life of a request in a colocated engine:
1. ``add_request`` validates it and queues a ``Sequence`` (WAITING). One with a structured output
   whose grammar is not compiled yet waits outside the scheduler, holding no batch slot, until
   its grammar is ready (``engine/grammar_waits.py``); the step loop runs on meanwhile.
2. ``step`` schedules it: its prompt is prefilled chunk by chunk, reusing cached prefix blocks.
3. The step that computes the last prompt token samples the first output token (TTFT).
4. Each later step decodes one token for it, batched with every other running sequence.
5. A stop condition finishes it; its blocks go back to the pool (full blocks stay in the prefix
   cache); the last ``StepOutput`` carries its finish reason and phase record.

Prefill-only mode (prefill worker) stops at step 3 with reason ``prefilled`` and keeps the blocks
until ``release`` is called after the KV transfer. Decode mode admits sequences whose prompt KV
was transferred in (``reserve`` + ``add_prefilled``) and can still prefill locally.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, EngineMode, SchedulerConfig
from pdserve.engine.errors import EngineStepError, GrammarError, InvalidRequestError, OutOfBlocksError, SamplingError
from pdserve.engine.grammar_waits import GrammarWaits
from pdserve.engine.model_runner import ForwardItem, ModelRunner, StepInterrupted
from pdserve.engine.omp_pool import on_fresh_thread
from pdserve.engine.sampler import Sampler, SampleResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.contract import PromptLogprobs, StepOutput  # noqa: F401  (StepOutput re-exported: the type the engine produces)
from pdserve.engine.sequence import FinishReason, Priority, Sequence, SequenceStatus
from pdserve.engine.stopping import StopChecker
from pdserve.engine.structured import GrammarBook

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.002   # an engine with only compiling grammars to wait for sleeps this long per step


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_held: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float
    prefix_hit_rate: float
    steps: int
    generated_tokens: int
    prompt_tokens_computed: int
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    # seconds of step time spent on prompt tokens (a step's time split by its tokens): with
    # prompt_tokens_computed, the engine's measured prefill rate when busy
    prefill_compute_s: float = 0.0
    # The ITL budget (EngineConfig.itl_target_ms): prompt tokens a step may take while sequences
    # decode (None: no target), and the most any step took beside decodes (what the cap held to).
    prefill_budget_tokens: int | None = None
    max_prefill_tokens_with_decodes: int = 0
    # batch-priority sequences (running or waiting) and the share of the KV blocks they hold
    num_batch_seqs: int = 0
    batch_kv_usage: float = 0.0


class ItlBudget:
    """How many prompt tokens a step may add beside its decodes and still end within the ITL
    target: (target - the decode-only step time) x the prefill rate, both measured here as
    moving averages of this engine's own steps. Clamped to [block_size, max_num_batched_tokens]
    so a prompt always progresses; until a prefill has been timed, ``FALLBACK_BLOCKS`` blocks."""

    FALLBACK_BLOCKS = 4
    WEIGHT = 0.3   # of the newest sample

    def __init__(self, target_ms: float, block_size: int, max_tokens: int) -> None:
        self.target_s = target_ms / 1000.0
        self.floor = min(block_size, max_tokens)
        self.ceiling = max_tokens
        self.fallback = min(max_tokens, self.FALLBACK_BLOCKS * block_size)
        self.decode_step_s: float | None = None
        self.prefill_tokens_per_s: float | None = None

    def tokens(self) -> int:
        if self.prefill_tokens_per_s is None:
            return self.fallback
        spare = self.target_s - (self.decode_step_s or 0.0)
        return max(self.floor, min(self.ceiling, int(spare * self.prefill_tokens_per_s)))

    def observe(self, decode_tokens: int, prefill_tokens: int, elapsed_s: float) -> None:
        """One step: ``decode_tokens`` sequences decoded, ``prefill_tokens`` prompt tokens."""
        if prefill_tokens == 0:
            if decode_tokens:
                self.decode_step_s = self._avg(self.decode_step_s, elapsed_s)
            return
        prefill_s = elapsed_s - ((self.decode_step_s or 0.0) if decode_tokens else 0.0)
        if prefill_s > 0:
            self.prefill_tokens_per_s = self._avg(self.prefill_tokens_per_s, prefill_tokens / prefill_s)

    def _avg(self, old: float | None, sample: float) -> float:
        return sample if old is None else self.WEIGHT * sample + (1 - self.WEIGHT) * old


def _set_scoring(item: ForwardItem, seq: Sequence) -> bool:
    """Point ``item`` at the prompt positions of its chunk not scored yet (vLLM's prompt_logprobs:
    row p scores prompt token p + 1); False when there are none."""
    lo = max(item.start_pos, len(seq.prompt_lp_entries))
    hi = min(item.start_pos + len(item.token_ids), seq.num_prompt_tokens - 1)
    if lo >= hi:
        return False
    item.score_targets = seq.prompt_token_ids[lo + 1:hi + 1]
    item.score_top = seq.params.prompt_logprobs or 0
    item.score_from = lo - item.start_pos
    return True


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        # Built (and warmed up, below) on a thread that exits: no OpenMP pool outlives it to slow
        # the steps of whichever thread runs them (engine/omp_pool.py).
        self.runner = runner or on_fresh_thread(lambda: ModelRunner(
            config.model_dir,
            dtype=config.dtype,
            device=config.device,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_cache_memory_gb=config.kv_cache_memory_gb,
            num_threads=config.num_threads,
            linear_backend=config.linear_backend,
            attention_backend=config.attention_backend,
        ))
        if config.num_threads is not None:  # this thread may step the engine too; torch's count is per thread
            torch.set_num_threads(config.num_threads)
        if config.dtype != self.runner.dtype_name:  # "auto" resolved: the KV layout needs the real one
            self.config = config = replace(config, dtype=self.runner.dtype_name)
        self.spec = self.runner.spec
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max(config.max_num_batched_tokens,
                                           1 if config.enable_chunked_prefill else self.max_model_len),
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.policy,
                prefill_pack_tokens=config.prefill_pack_tokens,
            ),
            self.block_manager,
        )
        self.sampler = Sampler(config.seed)
        # Set from another thread when an interactive request is on its way (EngineLoop.submit's
        # urgent): a step running only batch-priority work stops between two layers and is run
        # again later, so the new request waits for one layer instead of a whole batch step.
        self.interrupt = threading.Event()
        self.interrupted_steps = 0
        # Called on the engine's thread between two layers of every step (a prefill worker moves
        # its KV pushes on with it, which otherwise wait for the end of the next prompt's step).
        # It must not touch the scheduler or the block manager: a step is running.
        self.between_layers: Callable[[], None] | None = None
        # A sequence may not outgrow the whole KV pool: it would preempt itself forever.
        token_limit = min(self.max_model_len, self.runner.num_blocks * config.block_size)
        self.stopper = StopChecker(config.model_dir, self.spec.eos_token_ids, token_limit,
                                   emit_text=config.detokenize)
        self.grammars = GrammarBook(self.stopper.tokenizer, self.spec.vocab_size, tuple(self.spec.eos_token_ids),
                                    config.structured)
        self._grammar_waits = GrammarWaits()          # requests whose grammar still compiles
        self.mode = config.mode
        self._held: dict[str, Sequence] = {}          # prefill-only: finished, blocks kept for transfer
        self._pending: list[StepOutput] = []          # outputs produced outside step() (aborts, instant stops)
        self._steps = 0
        self._generated = 0
        self._prompt_computed = 0
        self._prefill_compute_s = 0.0
        self.itl_budget = ItlBudget(config.itl_target_ms, config.block_size, config.max_num_batched_tokens) \
            if config.itl_target_ms is not None and config.enable_chunked_prefill else None
        self._max_prefill_with_decodes = 0
        if config.warm_up:
            on_fresh_thread(lambda: self.runner.warm_up(self.scheduler.config.max_num_batched_tokens,
                                                        config.max_num_seqs, self.max_model_len))

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request. Raises ``InvalidRequestError`` for input that can never be served."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, priority)
        seq.prefill_only = self.mode is EngineMode.PREFILL
        if arrival_time is not None:
            seq.arrival_time = arrival_time

        def admit() -> None:
            self.stopper.start(seq)
            self.scheduler.add(seq)
        self._admit_when_compiled(seq, admit)
        return seq

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      priority: Priority) -> Sequence:
        self._validate(request_id, prompt_token_ids, params)
        seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                       priority=priority, eos_token_ids=frozenset(self.spec.eos_token_ids))
        if params.structured is not None:
            self.grammars.check(params.structured)   # limits (cheap) refused at once
            compiled = self.grammars.compiled(params.structured)
            if compiled.done():   # cached (a cached refusal raises here)
                seq.grammar = self.grammars.matcher(params.structured, compiled, params.prior_output)
        return seq

    def _admit_when_compiled(self, seq: Sequence, admit: Callable[[], None]) -> None:
        """``admit`` now, or once its grammar has compiled (``engine/grammar_waits.py``)."""
        if seq.params.structured is None or seq.grammar is not None:
            admit()
        else:
            self._grammar_waits.park(seq, self.grammars.compiled(seq.params.structured), admit)

    def _admit_compiled(self) -> list[StepOutput]:
        """Admit the parked requests whose grammar is ready; end those whose compile failed."""
        outputs = []
        for parked in self._grammar_waits.ready():
            seq, structured = parked.seq, parked.seq.params.structured
            try:
                seq.grammar = self.grammars.matcher(structured, parked.compiled, seq.params.prior_output)
                parked.admit()
            except Exception as exc:
                outputs.append(self._end_parked(seq, FinishReason.ERROR, exc))
        return outputs

    def _end_parked(self, seq: Sequence, reason: FinishReason, exc: Exception | None = None) -> StepOutput:
        self.block_manager.free(seq)   # the transferred KV of a decode-side request
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        if exc is not None:
            seq.error = str(exc)
        out = self._final_output(seq, [])
        if isinstance(exc, InvalidRequestError):
            out.error_code = GrammarError.code
        return out

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if self.scheduler.get(request_id) is not None or request_id in self._held or request_id in self._grammar_waits:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        if len(prompt) == 0:
            raise InvalidRequestError("the prompt is empty: send at least one token")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens but the context length is {self.max_model_len}; "
                f"shorten it to at most {self.max_model_len - 1} tokens"
            )
        vocab = self.spec.vocab_size
        for tok in prompt:
            if isinstance(tok, bool) or not isinstance(tok, int) or not (0 <= tok < vocab):
                raise InvalidRequestError(f"token id {tok!r} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.allowed_token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"allowed_token_ids names token id {bad}, outside the vocabulary [0, {vocab})")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias names token id {bad}, outside the vocabulary [0, {vocab})")
        need = -(-(len(prompt) + 1) // self.config.block_size)
        if need > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"the prompt needs {need} KV blocks but this worker's cache has {self.block_manager.num_blocks}"
            )

    def abort(self, request_id: str) -> bool:
        """Cancel a request wherever it is; its blocks are freed. Returns False if unknown."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self.block_manager.free(held)
            return True
        parked = self._grammar_waits.pop(request_id)
        if parked is not None:
            self._pending.append(self._end_parked(parked.seq, FinishReason.ABORT))
            return True
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self.stopper.discard(request_id)
        seq.finished_time = time.monotonic()
        self._pending.append(self._final_output(seq, []))
        return True

    def fail_all(self, message: str) -> list[StepOutput]:
        """End every request in flight with an error (after an unrecoverable step failure)."""
        outputs, self._pending = self._pending, []
        parked = [p.seq for p in self._grammar_waits.take_all()]
        for seq in self.scheduler.running() + self.scheduler.waiting() + parked:
            self.scheduler.finish(seq, FinishReason.ERROR)
            self.stopper.discard(seq.request_id)
            seq.error = message
            seq.finished_time = time.monotonic()
            out = self._final_output(seq, [])
            out.error_code = EngineStepError.code
            outputs.append(out)
        return outputs

    # ------------------------------------------------------------- decode side
    def reserve(self, num_blocks: int) -> list[int]:
        """Reserve raw blocks for a prompt's KV that another worker will write (decode mode)."""
        if num_blocks < 1:
            raise InvalidRequestError("num_blocks to reserve must be >= 1")
        if num_blocks > self.block_manager.num_free_blocks:
            raise OutOfBlocksError(
                f"need {num_blocks} KV blocks, {self.block_manager.num_free_blocks} free"
            )
        return self.block_manager.reserve(num_blocks)

    def release_reserved(self, block_ids: list[int]) -> None:
        self.block_manager.release(block_ids)

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        block_ids: list[int],
        priority: Priority = Priority.INTERACTIVE,
        arrival_time: float | None = None,
        first_token_time: float | None = None,
    ) -> Sequence:
        """Admit a request whose prompt K/V landed in ``block_ids`` and whose first token is known."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, priority)
        now = time.monotonic()
        seq.arrival_time = arrival_time if arrival_time is not None else now
        seq.first_scheduled_time = seq.arrival_time
        seq.first_token_time = first_token_time if first_token_time is not None else now

        def follows() -> None:
            if seq.grammar is not None and not seq.grammar.accept(first_token_id):
                raise InvalidRequestError(f"request {request_id}: its first token {first_token_id} does not follow "
                                          f"its {params.structured.kind}")
        follows()   # a cached grammar: refused before the blocks become the request's
        parked = seq.grammar is None

        def admit() -> None:
            if parked:   # its grammar came later
                follows()
            self.stopper.start(seq)
            seq.status = SequenceStatus.RUNNING
            reason = self.stopper.check(seq)
            if reason is not None:
                self.block_manager.free(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                seq.finished_time = time.monotonic()
                self._pending.append(self._final_output(seq, []))
                return
            self.scheduler.add_prefilled(seq)
        self.block_manager.adopt(seq, block_ids)
        seq.num_computed_tokens = len(prompt_token_ids)
        seq.output_token_ids.append(first_token_id)
        self._admit_when_compiled(seq, admit)
        return seq

    # ------------------------------------------------------------ prefill side
    def release(self, request_id: str) -> None:
        """Free the blocks a prefill-only request kept for its KV transfer."""
        seq = self._held.pop(request_id, None)
        if seq is not None:
            self.block_manager.free(seq)

    def held(self, request_id: str) -> Sequence | None:
        return self._held.get(request_id)

    # -------------------------------------------------------------------- step
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or bool(self._grammar_waits)

    def _layer_check(self, batch_only: bool) -> Callable[[], bool] | None:
        """What the runner asks between two layers: run ``between_layers``, and (in a step of
        batch work only) whether an interactive arrival interrupts the step."""
        hook, interrupted = self.between_layers, self.interrupt.is_set
        if hook is None:
            return interrupted if batch_only else None

        def check() -> bool:
            hook()
            return batch_only and interrupted()
        return check

    def step(self) -> list[StepOutput]:
        """Run one iteration: schedule, forward, sample, check stops."""
        outputs, self._pending = self._pending, []
        if self._grammar_waits:
            outputs += self._admit_compiled()
        budget = self.itl_budget.tokens() if self.itl_budget is not None else None
        sched = self.scheduler.schedule(prefill_budget=budget)
        if sched.is_empty:
            if not outputs:   # only grammars to wait for: sleep on them rather than spin
                self._grammar_waits.wait(GRAMMAR_POLL_S)
            return outputs
        t0 = time.monotonic()
        items = [
            ForwardItem(c.seq.token_ids[c.start : c.start + c.num_tokens], c.start, c.seq.block_table, c.sample)
            for c in sched.chunks
        ]
        scoring = {i: c.seq for i, c in enumerate(sched.chunks)
                   if c.seq.params.prompt_logprobs is not None and _set_scoring(items[i], c.seq)}
        batch_only = all(c.seq.priority is Priority.BATCH for c in sched.chunks)
        try:
            logits, scores = self.runner.execute_scored(items, stop=self._layer_check(batch_only))
        except StepInterrupted:
            # Nothing was advanced: every chunk is scheduled again (its K/V rewritten, the same values).
            self.interrupted_steps += 1
            return outputs
        for i, (entries, ranks) in scores.items():
            scoring[i].prompt_lp_entries += entries
            scoring[i].prompt_lp_ranks += ranks
        sampling = [c.seq for c in sched.chunks if c.sample]
        result = self.sampler.sample(logits, sampling) if sampling else SampleResult([], [])
        for i, seq in enumerate(sampling):  # each grammar advances by the token its mask allowed
            if seq.grammar is not None and i not in result.failed and not seq.grammar.accept(result.tokens[i]):
                result.failed[i] = SamplingError(f"request {seq.request_id}: token {result.tokens[i]} does not "
                                                 f"follow its {seq.params.structured.kind}")
        now = time.monotonic()
        self._account_prefill(sched, now - t0)
        if self.itl_budget is not None:
            self.itl_budget.observe(sched.num_decode_tokens, sched.num_prefill_tokens, now - t0)
        if sched.num_decode_tokens and sched.num_prefill_tokens > self._max_prefill_with_decodes:
            self._max_prefill_with_decodes = sched.num_prefill_tokens
        # A row that could not be sampled fails its own request (blocks freed); the rest go on.
        for i, exc in result.failed.items():
            outputs.append(self._fail_request(sampling[i], exc, now))
        ok = [i for i in range(len(sampling)) if i not in result.failed]
        sampled = [sampling[i] for i in ok]
        tokens = [result.tokens[i] for i in ok]
        self.scheduler.postprocess(sched, {s.request_id: t for s, t in zip(sampled, tokens)})
        self._steps += 1
        outputs.extend(self._collect(sched, sampled, tokens, [result.logprobs[i] for i in ok], now))
        return outputs

    def _fail_request(self, seq: Sequence, exc: SamplingError, now: float) -> StepOutput:
        """End one request whose sampling failed: its blocks are freed, its output says why."""
        logger.warning("request %s failed alone: %s", seq.request_id, exc)
        self.scheduler.finish(seq, FinishReason.ERROR)
        self.stopper.discard(seq.request_id)
        seq.error = str(exc)
        seq.finished_time = now
        out = self._final_output(seq, [])
        out.error_code = exc.code
        return out

    def _account_prefill(self, sched: SchedulerOutput, elapsed: float) -> None:
        total = sched.num_batched_tokens or 1
        for c in sched.chunks:
            if c.seq.first_token_time is None:
                c.seq.prefill_compute_s += elapsed * c.num_tokens / total
                self._prefill_compute_s += elapsed * c.num_tokens / total
                self._prompt_computed += c.num_tokens

    def _collect(self, sched: SchedulerOutput, sampling: list[Sequence], tokens: list[int],
                 logprobs: list, now: float) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for seq, tok, lp in zip(sampling, tokens, logprobs):
            self._generated += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if lp is not None:
                seq.output_logprobs.append(lp)
            delta = self.stopper.push(seq, tok)
            reason = self.stopper.check(seq)
            if reason is None and seq.prefill_only:
                reason = FinishReason.PREFILLED
            out = StepOutput(seq.request_id, [tok], [lp] if lp is not None else None, delta,
                             num_computed_tokens=seq.num_computed_tokens)
            if seq.params.prompt_logprobs is not None and len(seq.output_token_ids) == 1:
                out.prompt_logprobs = PromptLogprobs(tuple(seq.prompt_lp_entries), tuple(seq.prompt_lp_ranks))
            if reason is not None:
                keep = reason is FinishReason.PREFILLED
                self.scheduler.finish(seq, reason, free_blocks=not keep)
                seq.finished_time = now
                if keep:
                    self._held[seq.request_id] = seq
                out.text_delta += self.stopper.flush(seq)
                out.finished = True
                out.finish_reason = reason.value
                phase = seq.phase_record()
                out.phase = phase.but(prefill_s=seq.prefill_compute_s or phase.prefill_s)
            outputs.append(out)
        # Prefill progress for chunks that did not sample (prefill-only workers stream blocks early).
        for c in sched.chunks:
            if not c.sample and c.seq.prefill_only:
                outputs.append(StepOutput(c.seq.request_id, num_computed_tokens=c.seq.num_computed_tokens))
        return outputs

    def _final_output(self, seq: Sequence, new: list[int]) -> StepOutput:
        phase = seq.phase_record()
        return StepOutput(seq.request_id, new, finished=True,
                          finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                          phase=phase, error=seq.error)

    # ---------------------------------------------------------------- helpers
    def stats(self) -> EngineStats:
        bm = self.block_manager
        batch_seqs, batch_blocks = self.scheduler.batch_load()
        return EngineStats(
            num_batch_seqs=batch_seqs,
            batch_kv_usage=min(bm.usage, batch_blocks / max(1, bm.num_blocks)),
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + len(self._grammar_waits),
            num_held=len(self._held),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            kv_usage=bm.usage,
            prefix_hit_rate=bm.hit_rate,
            steps=self._steps,
            generated_tokens=self._generated,
            prompt_tokens_computed=self._prompt_computed,
            prefix_query_tokens=bm.prefix_query_tokens,
            prefix_hit_tokens=bm.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions_total,
            prefill_compute_s=self._prefill_compute_s,
            prefill_budget_tokens=self.itl_budget.tokens() if self.itl_budget is not None else None,
            max_prefill_tokens_with_decodes=self._max_prefill_with_decodes,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion (tests, benchmarks); returns generated token ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._steps}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        result: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in result:
                    result[out.request_id].extend(out.new_token_ids)
                if out.finished and out.request_id in self._held:
                    self.release(out.request_id)
        return [result[rid] for rid in ids]
