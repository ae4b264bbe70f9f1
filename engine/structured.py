"""Structured outputs: a grammar that every token a request samples must follow.

A request asks for one of six kinds (``StructuredOutput.kind``): ``json_schema`` (OpenAI's
``response_format`` with a schema, vLLM's ``guided_json``), ``json_object`` (any JSON object),
``regex``, ``choice`` (exactly one of a list of strings), ``grammar`` (EBNF, as llama.cpp's
GBNF and vLLM's ``guided_grammar``) or ``structural_tag`` (free text in which each trigger opens
a tagged JSON value: tool calls with ``tool_choice`` auto, ``router/tools.py``). The grammar engine is xgrammar (chosen by measured
per-token cost, ``bench/grammar_libs.py`` and ``docs/benchmarks.md``).

* ``StructuredOutput`` and its tokenizer-free grammar are in ``engine/grammar_spec.py``.
* ``check_limits`` bounds a spec before anything parses it: its size (``MAX_SPEC_CHARS``) and its
  nesting (``StructuredLimits.max_depth``, read by a scanner, not a parser: a schema nested 900 deep
  took xgrammar 35 s to parse).
* ``check`` parses the grammar without a tokenizer, at the door: a malformed schema, regex or
  grammar is the client's 400, never a worker's error.
* ``GrammarBook`` lives in an engine: it compiles each grammar once for the model's vocabulary,
  off the step loop, and makes a matcher per request. A compile cannot be cancelled, so each is
  first tried in a small niced process that is killed when ``compile_timeout_s`` is up
  (``engine/grammar_process.py``); only a grammar that compiled there in time is compiled again
  in the engine's process (a compiled grammar cannot be passed back: xgrammar's serialized form
  of a 1,200-property schema is 0.5 GB and takes longer to write than to compile). Results,
  refusals included, are cached by the spec's text.
* The sampler asks each constrained row's matcher for its allowed tokens (a bitmask) and masks
  the rest to -inf before greedy or sampled choice; the engine then advances the matcher by
  the chosen token. Rows without a grammar pay nothing.
* A grammar's state is the tokens it has consumed, so it follows a request anywhere: a decode
  worker's matcher consumes the first token the prefill worker sampled, and after a migration
  ``SamplingParams.prior_output`` (the tokens the client already got) is consumed first.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine.config import MAX_DEPTH_CEILING, StructuredLimits
from pdserve.engine.errors import GrammarError, InvalidRequestError
from pdserve.engine.grammar_process import COMPILE_NICENESS, GrammarProcess
from pdserve.engine.grammar_spec import MAX_SPEC_CHARS, StructuredOutput, build_grammar, reason, xgrammar_module

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 256   # compiled grammars (and refusals) an engine keeps, least recently used dropped


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_JSON_BRACKETS = re.compile(r"[\[\]{}]")
# Escapes and character classes of a regex (and quoted strings of EBNF) hold no groups.
_REGEX_INERT = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]", re.S)
_EBNF_INERT = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'", re.S)
_PARENS = re.compile(r"[()]")


def _depth(tokens: list[str], opening: str, limit: int) -> int:
    """The deepest nesting of ``tokens`` (each an opening or a closing bracket), up to ``limit + 1``."""
    depth = best = 0
    for tok in tokens:
        if tok in opening:
            depth += 1
            if depth > best:
                best = depth
                if best > limit:
                    break
        else:
            depth -= 1
    return best


def json_depth(text: str, limit: int = MAX_DEPTH_CEILING) -> int:
    """How deep JSON text nests (``[`` and ``{`` outside strings), without parsing it; stops
    counting past ``limit``. Malformed text gets a number too: the parser refuses it later."""
    return _depth(_JSON_BRACKETS.findall(_JSON_STRING.sub("", text)), "[{", limit)


def group_depth(text: str, *, ebnf: bool = False, limit: int = MAX_DEPTH_CEILING) -> int:
    """How deep a regex's (or an EBNF grammar's) parenthesised groups nest, without parsing it."""
    inert = _EBNF_INERT if ebnf else _REGEX_INERT
    return _depth(_PARENS.findall(inert.sub("", text)), "(", limit)


def check_limits(s: StructuredOutput, limits: StructuredLimits) -> None:
    """Refuse a spec nested deeper than ``limits.max_depth``; cheap (no parse), so it runs before
    anything parses or compiles the spec."""
    if s.kind in ("json_schema", "structural_tag"):
        depth, what = json_depth(s.spec, limits.max_depth), "levels of JSON"
    elif s.kind in ("regex", "grammar"):
        depth, what = group_depth(s.spec, ebnf=s.kind == "grammar", limit=limits.max_depth), "levels of groups"
    else:
        return
    if depth > limits.max_depth:
        raise InvalidRequestError(f"the {s.kind.replace('_', ' ')} nests more than {limits.max_depth} {what}, "
                                  f"the most this server compiles (structured.max_depth)")


def check(s: StructuredOutput, limits: StructuredLimits | None = None) -> None:
    """Refuse a malformed schema, regex or grammar before the request is accepted (``limits``
    first: default ``StructuredLimits()``)."""
    check_limits(s, limits or StructuredLimits())
    if s.kind == "json_schema":
        try:
            json.loads(s.spec)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
    build_grammar(s)


class TagPosition:
    """Whether a structural-tag output is in free text or inside a tag (the tool call's JSON), read
    from the bytes of the tokens it accepted: a trigger opens a tag, a tag's end string closes it."""

    __slots__ = ("_triggers", "_ends", "_vocab", "_tail", "_keep", "inside")

    def __init__(self, triggers: list[str], ends: list[str], vocab: list[bytes]) -> None:
        self._triggers = [t.encode() for t in triggers]
        self._ends = [e.encode() for e in ends]
        self._vocab = vocab
        self._keep = max(len(x) for x in self._triggers + self._ends) - 1   # a pattern split across tokens
        self._tail = b""
        self.inside = False

    def push(self, token_id: int) -> None:
        buf = self._tail + (self._vocab[token_id] if 0 <= token_id < len(self._vocab) else b"")
        pos = 0
        while True:
            hits = [i + len(p) for p in (self._ends if self.inside else self._triggers) if (i := buf.find(p, pos)) >= 0]
            if not hits:
                break
            pos = min(hits)
            self.inside = not self.inside
        self._tail = buf[max(pos, len(buf) - self._keep):]


class RequestGrammar:
    """One request's place in its grammar: the xgrammar matcher plus, for JSON, the tokens
    that hold a raw control byte (U+0000-U+001F), banned outright: valid JSON never has one
    outside an escape, and xgrammar 0.2.9's length-bounded strings (``maxLength``) let them in.
    A structural tag (tool calls) is free text with JSON in its tags: the ban holds inside a tag
    only (``tags``), so free text keeps its newlines."""

    __slots__ = ("kind", "matcher", "_ban", "_tags")

    def __init__(self, kind: str, matcher: Any, ban: torch.Tensor | None, tags: TagPosition | None = None) -> None:
        self.kind = kind
        self.matcher = matcher
        self._ban = ban
        self._tags = tags

    @property
    def ban(self) -> torch.Tensor | None:
        """The tokens to refuse next besides the matcher's, as a packed allow-mask; None: none."""
        return self._ban if self._tags is None or self._tags.inside else None

    def accept(self, token_id: int) -> bool:
        ok = bool(self.matcher.accept_token(token_id))
        if ok and self._tags is not None:
            self._tags.push(token_id)
        return ok


class GrammarBook:
    """One engine's grammars: each compiled once for the model's vocabulary on the book's own
    thread (niced, never the engine's), after the compile process proved that it finishes within
    ``limits.compile_timeout_s``; the vocabulary as xgrammar sees it is built there on first use.

    ``compiled`` answers at once with a ``Future``: the engine parks the request until it is done
    (``engine/grammar_waits.py``) and then makes the request's matcher with ``matcher``."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 limits: StructuredLimits | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self.limits = limits or StructuredLimits()
        self._control_ban: torch.Tensor | None = None
        self._decoded_vocab: list[bytes] = []
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._jobs: queue.SimpleQueue[tuple[StructuredOutput, Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.process = None    # the GrammarProcess (its counters), made on the book's thread
        self.compiles = 0      # grammars compiled (cache misses that reached the compile process)

    def check(self, s: StructuredOutput) -> None:
        """The cheap limits (``check_limits``), on the caller's thread."""
        check_limits(s, self.limits)

    def compiled(self, s: StructuredOutput) -> Future:
        """``s`` compiled for this vocabulary: a done future when cached (a refusal is cached
        too), else one that the book's thread completes with the grammar or a ``GrammarError``."""
        with self._lock:
            fut = self._cache.get(s.key)
            if fut is not None:
                self._cache.move_to_end(s.key)
                return fut
            fut = Future()
            self._cache[s.key] = fut
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-compiler", daemon=True)
                self._thread.start()
            self._jobs.put((s, fut))
            return fut

    def matcher(self, s: StructuredOutput, compiled: Future, prior: tuple[int, ...] = ()) -> RequestGrammar:
        """A fresh place in ``s`` (whose ``compiled`` future is done) that has consumed ``prior``
        (an earlier attempt's output); raises the compile's ``GrammarError``."""
        xgr = xgrammar_module()
        tags = None
        grammar = compiled.result(timeout=0)
        if s.kind == "structural_tag":
            spec = json.loads(s.spec)
            tags = TagPosition(spec["triggers"], [t["end"] for t in spec["tags"]], self._decoded_vocab)
        g = RequestGrammar(s.kind, xgr.GrammarMatcher(grammar),
                           self._control_ban if s.kind in ("json_schema", "json_object", "structural_tag") else None,
                           tags)
        for tok in prior:
            if not g.accept(tok):
                raise GrammarError(f"token {tok} already emitted does not follow the {s.kind}")
        return g

    def grammar(self, s: StructuredOutput, prior: tuple[int, ...] = ()) -> RequestGrammar:
        """``matcher`` after waiting for the compile here (benchmarks and tests, never the engine)."""
        self.check(s)
        fut = self.compiled(s)
        fut.exception()   # waits
        return self.matcher(s, fut, prior)

    def close(self) -> None:
        """Stop the book's thread and its compile process (a later ``compiled`` starts them again)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout=10)

    # ------------------------------------------------------------ book thread
    def _run(self) -> None:
        _lower_thread_priority()
        try:
            compiler, process = self._start()
            self.process = process
        except Exception as exc:  # the engine's own failure (no xgrammar, no tokenizer): not the requests'
            logger.exception("structured outputs cannot start")
            compiler, process, failure = None, None, exc
        try:
            while (job := self._jobs.get()) is not None:
                s, fut = job
                if compiler is None:
                    self._forget(s, fut)
                    fut.set_exception(RuntimeError(f"structured outputs are unavailable here: {failure}"))
                    continue
                self._compile(compiler, process, s, fut)
        finally:
            if process is not None:
                process.close()

    def _start(self) -> tuple[Any, Any]:
        xgr = xgrammar_module()
        info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                  stop_token_ids=self._eos or None)
        self._decoded_vocab = list(info.decoded_vocab)
        self._control_ban = _control_byte_tokens(self._decoded_vocab, self._vocab_size, set(self._eos))
        process = GrammarProcess(info.serialize_json(), self.limits.compile_timeout_s)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), process

    def _compile(self, compiler: Any, process: Any, s: StructuredOutput, fut: Future) -> None:
        self.compiles += 1
        try:
            process.compile(s.kind, s.spec)            # the budget, enforced: killed when it is up
            grammar = compiler.compile_grammar(build_grammar(s))   # proven to finish within it
        except InvalidRequestError as exc:
            fut.set_exception(exc if isinstance(exc, GrammarError) else GrammarError(str(exc)))
        except Exception as exc:
            logger.exception("compiling a %s failed", s.kind)
            self._forget(s, fut)
            fut.set_exception(RuntimeError(f"the {s.kind} could not be compiled here: {reason(exc)}"))
        else:
            fut.set_result(grammar)

    def _forget(self, s: StructuredOutput, fut: Future) -> None:
        """Drop a failure that is not the spec's fault from the cache: the next request retries."""
        with self._lock:
            if self._cache.get(s.key) is fut:
                del self._cache[s.key]


def _lower_thread_priority() -> None:
    """Nice the calling thread (Linux schedules threads one by one), so that a compile takes the
    cores only when the engine's step loop leaves them."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not permitted: compiles at normal priority
        pass


def _control_byte_tokens(decoded_vocab: list[bytes], vocab_size: int, keep: set[int]) -> torch.Tensor:
    """A packed bitmask (xgrammar's layout: bit ``i % 32`` of word ``i // 32``) with a 1 for every
    token that holds no byte below 0x20; special tokens and ``keep`` (EOS) stay allowed."""
    import torch

    words = (vocab_size + 31) // 32
    allowed = torch.ones(words * 32, dtype=torch.bool, device="cpu")
    for i, raw in enumerate(decoded_vocab[:vocab_size]):
        if i not in keep and raw and any(b < 0x20 for b in raw):
            allowed[i] = False
    bits = allowed.view(words, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64, device="cpu")
    packed = bits.sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def apply_masks(logits: torch.Tensor, rows: list[int], grammars: list[RequestGrammar]) -> None:
    """Mask, in place, every token each row's grammar does not allow next (-inf)."""
    xgr = xgrammar_module()
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, g in zip(rows, grammars):
        g.matcher.fill_next_token_bitmask(bitmask, row)
        if g.ban is not None:
            bitmask[row, : g.ban.numel()] &= g.ban
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
