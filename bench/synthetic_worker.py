"""A decode worker without a model, for measuring routers alone (``pdserve bench router --routers``).

It speaks the decode worker's interface as routers use it with ``disaggregation.mode: never``
(``generate_local``, ``take_outputs`` per router, ``abort``, ``stats``, ``metadata``,
``take_stream``) and emits one token per running request every ``step_s`` seconds, in one
output batch per step, as a real decode worker does: what reaches the routers is the same
stream of Ray calls and outputs, at a rate no model on these cores could produce, so that the
routers, not the worker, are what the benchmark saturates. Tokens are deterministic
(``(prompt length + i) % 251 + 3``); a request ends with ``length`` after ``max_tokens``.
"""

from __future__ import annotations

import os
import threading
import time

from pdserve.engine.contract import RequestPhase, StepOutput, WorkerRole, WorkerStats


class SyntheticDecodeWorker:
    def __init__(self, worker_id: str, step_s: float = 0.02, max_num_seqs: int = 256) -> None:
        self.worker_id = worker_id
        self.step_s = step_s
        self.max_num_seqs = max_num_seqs
        self._running: dict[str, list] = {}      # request id -> [owner, prompt len, produced, max_tokens, started]
        self._outboxes: dict[str, list[StepOutput]] = {}
        self._cv = threading.Condition()
        self.generated = 0
        self.started_at = time.time()
        self._stop = threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="synthetic-steps").start()

    # ------------------------------------------------------------- the worker API routers use
    def metadata(self) -> bytes:
        return self.worker_id.encode()

    def add_peer(self, _metadata: bytes) -> str:
        return ""

    def generate_local(self, request_id: str, prompt_token_ids: list[int], params, priority=None,
                       owner: str = "", resume_key: str = "") -> None:
        with self._cv:
            self._running[request_id] = [owner, len(prompt_token_ids), 0, params.max_tokens, time.monotonic()]

    def abort(self, request_id: str, sender_dead: bool = False) -> bool:
        with self._cv:
            entry = self._running.pop(request_id, None)
            if entry is None:
                return False
            self._outboxes.setdefault(entry[0], []).append(StepOutput(request_id, finished=True, finish_reason="abort"))
            self._cv.notify_all()
        return True

    def take_outputs(self, timeout_s: float = 0.05, owner: str = "") -> list[StepOutput]:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._outboxes.get(owner):
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cv.wait(left)
            return self._outboxes.pop(owner)

    def take_stream(self, resume_key: str):
        return None

    def take_kv_events(self) -> list:
        return []

    def blocks_in_use(self) -> int:
        return 0

    def stats(self) -> WorkerStats:
        with self._cv:
            running = len(self._running)
        return WorkerStats(
            worker_id=self.worker_id, role=WorkerRole.DECODE, num_running=running, num_waiting=0,
            num_free_blocks=100_000, num_blocks=100_000, kv_usage=0.0, prefix_hit_rate=0.0,
            generated_tokens=self.generated, prompt_tokens_computed=0, prefill_compute_s=0.0,
            prefill_budget_tokens=None, max_prefill_tokens_with_decodes=0, kv_open_transfers=0, kv_mailboxes=0,
            started_at=self.started_at, niceness=0, pid=os.getpid(), transfer_timeout_s=None,
            dtype="none", num_threads=0, attention_backend="synthetic")

    def shutdown(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------------------ steps
    def _loop(self) -> None:
        while not self._stop.wait(self.step_s):
            with self._cv:
                for rid, entry in list(self._running.items()):
                    owner, prompt_len, produced, max_tokens, started = entry
                    token = (prompt_len + produced) % 251 + 3
                    entry[2] = produced = produced + 1
                    done = produced >= max_tokens
                    out = StepOutput(rid, new_token_ids=[token], finished=done,
                                     finish_reason="length" if done else None)
                    if done:
                        del self._running[rid]
                        elapsed = time.monotonic() - started
                        out.phase = RequestPhase(prompt_tokens=prompt_len, output_tokens=produced, decode_s=elapsed,
                                                 total_s=elapsed, finish_reason="length",
                                                 decode_worker=self.worker_id)
                    self._outboxes.setdefault(owner, []).append(out)
                    self.generated += 1
                if self._outboxes:
                    self._cv.notify_all()
