"""Structured outputs: a grammar that every token a request samples must follow.

A request asks for one of six kinds (``StructuredOutput.kind``): ``json_schema`` (OpenAI's
``response_format`` with a schema, vLLM's ``guided_json``), ``json_object`` (any JSON object),
``regex``, ``choice`` (exactly one of a list of strings), ``grammar`` (EBNF, as llama.cpp's
GBNF and vLLM's ``guided_grammar``) or ``structural_tag`` (free text in which each trigger opens
a tagged JSON value: tool calls with ``tool_choice`` auto, ``router/tools.py``). The grammar engine is xgrammar (chosen by measured
per-token cost, ``bench/grammar_libs.py`` and ``docs/benchmarks.md``).

* ``check`` parses the grammar without a tokenizer, at the door: a malformed schema, regex or
  grammar is the client's 400, never a worker's error.
* ``GrammarBook`` lives in an engine: it compiles each grammar once for the model's vocabulary
  (xgrammar caches compiled grammars by their text) and makes a matcher per request.
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
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 64 * 1024   # a schema, regex or grammar larger than this is refused
MAX_CHOICES = 256


def _xgr():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - make setup installs it
        raise InvalidRequestError(
            "structured outputs need the xgrammar package, which this installation lacks; "
            "run `make setup` (or `pip install --no-deps xgrammar apache-tvm-ffi`)") from exc
    return xgrammar


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's output must match. ``spec``: the JSON schema's text (``json_schema``),
    the regex, the EBNF grammar, a JSON list of strings (``choice``), the tags (``structural_tag``);
    empty for ``json_object``."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"a {self.kind} may be at most {MAX_SPEC_CHARS} characters")

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.spec)


def choice_spec(choices: object) -> str:
    """``guided_choice``'s list, checked, as the spec text."""
    if not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES \
            or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(f"guided_choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
    return json.dumps(choices)


_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}-/")


def _choice_regex(spec: str) -> str:
    """An alternation matching exactly one of the choices (only regex syntax is escaped)."""
    return "(" + "|".join("".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c)
                          for c in json.loads(spec)) + ")"


def _reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[08:20:04] /project/cpp/x.cc:94: ")."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", first)


def _grammar(s: StructuredOutput) -> Any:
    """The tokenizer-free grammar; ``InvalidRequestError`` naming what is wrong with it."""
    xgr = _xgr()
    try:
        if s.kind == "json_object":  # any JSON object (OpenAI's JSON mode), compact like a schema's
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if s.kind == "json_schema":
            return xgr.Grammar.from_json_schema(s.spec, any_whitespace=False, strict_mode=True)
        if s.kind == "regex":
            return xgr.Grammar.from_regex(s.spec)
        if s.kind == "choice":
            return xgr.Grammar.from_regex(_choice_regex(s.spec))
        if s.kind == "structural_tag":  # free text; after a trigger, a tagged JSON value (tool calls)
            spec = json.loads(s.spec)
            tags = [{"type": "tag", "begin": t["begin"], "end": t["end"],
                     "content": {"type": "json_schema", "json_schema": t["schema"], "max_whitespace_cnt": 1}}
                    for t in spec["tags"]]
            return xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": {
                "type": "triggered_tags", "triggers": spec["triggers"], "tags": tags}})
        return xgr.Grammar.from_ebnf(s.spec)
    except InvalidRequestError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the parser's message
        raise InvalidRequestError(f"the {s.kind.replace('_', ' ')} could not be compiled: {_reason(exc)}") from None


def check(s: StructuredOutput) -> None:
    """Refuse a malformed schema, regex or grammar before the request is accepted."""
    if s.kind == "json_schema":
        try:
            json.loads(s.spec)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
    _grammar(s)


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
    """One engine's grammars: the model's vocabulary as xgrammar sees it (built on first use,
    ~0.15 s for 49k tokens) and each grammar compiled once."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._compiler = None
        self._control_ban: torch.Tensor | None = None
        self._decoded_vocab: list[bytes] = []
        self._lock = threading.Lock()

    def _compiler_once(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._eos or None)
                self._decoded_vocab = list(info.decoded_vocab)
                self._control_ban = _control_byte_tokens(self._decoded_vocab, self._vocab_size, set(self._eos))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def grammar(self, s: StructuredOutput, prior: tuple[int, ...] = ()) -> RequestGrammar:
        """A fresh place in ``s`` that has consumed ``prior`` (an earlier attempt's output)."""
        xgr = _xgr()
        compiler = self._compiler_once()
        try:
            compiled = compiler.compile_grammar(_grammar(s))
        except InvalidRequestError:
            raise
        except Exception as exc:
            raise InvalidRequestError(f"the {s.kind.replace('_', ' ')} could not be compiled: {_reason(exc)}") from None
        tags = None
        if s.kind == "structural_tag":
            spec = json.loads(s.spec)
            tags = TagPosition(spec["triggers"], [t["end"] for t in spec["tags"]], self._decoded_vocab)
        g = RequestGrammar(s.kind, xgr.GrammarMatcher(compiled),
                           self._control_ban if s.kind in ("json_schema", "json_object", "structural_tag") else None,
                           tags)
        for tok in prior:
            if not g.accept(tok):
                raise InvalidRequestError(f"token {tok} already emitted does not follow the {s.kind}")
        return g


def _control_byte_tokens(decoded_vocab: list[bytes], vocab_size: int, keep: set[int]) -> torch.Tensor:
    """A packed bitmask (xgrammar's layout: bit ``i % 32`` of word ``i // 32``) with a 1 for every
    token that holds no byte below 0x20; special tokens and ``keep`` (EOS) stay allowed."""
    import torch

    words = (vocab_size + 31) // 32
    allowed = torch.ones(words * 32, dtype=torch.bool)
    for i, raw in enumerate(decoded_vocab[:vocab_size]):
        if i not in keep and raw and any(b < 0x20 for b in raw):
            allowed[i] = False
    bits = allowed.view(words, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    packed = bits.sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def apply_masks(logits: torch.Tensor, rows: list[int], grammars: list[RequestGrammar]) -> None:
    """Mask, in place, every token each row's grammar does not allow next (-inf)."""
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, g in zip(rows, grammars):
        g.matcher.fill_next_token_bitmask(bitmask, row)
        if g.ban is not None:
            bitmask[row, : g.ban.numel()] &= g.ban
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
