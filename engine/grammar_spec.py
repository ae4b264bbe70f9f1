"""What a structured output asks for, and its grammar: ``StructuredOutput`` (a kind and a spec),
checked as it is made, and ``build_grammar``, the tokenizer-free xgrammar grammar of one (a
malformed spec is an ``InvalidRequestError`` naming what is wrong). Shared by the engine's
``GrammarBook`` (``engine/structured.py``) and its compile process (``engine/grammar_process.py``);
xgrammar itself is imported on first use.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.engine.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 64 * 1024   # a schema, regex or grammar larger than this is refused
MAX_CHOICES = 256


def xgrammar_module():
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


def reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[08:20:04] /project/cpp/x.cc:94: ")."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", first)


def build_grammar(s: StructuredOutput) -> Any:
    """The tokenizer-free grammar; ``InvalidRequestError`` naming what is wrong with it."""
    xgr = xgrammar_module()
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
        raise InvalidRequestError(f"the {s.kind.replace('_', ' ')} could not be compiled: {reason(exc)}") from None
