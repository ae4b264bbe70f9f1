"""Loading a checkpoint's tokenizer from a local directory, and UTF-8-safe incremental detokenisation."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers.decoders import DecodeStream

from pdserve.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
_CONTEXT = 6  # prompt tokens decoded before the first output token (a leading space, a split character)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer that ships with a local Hugging Face checkpoint (never from a hub): the
    tokenizer ``AutoTokenizer`` loads, read without its detour through the model's config class
    where ``generic_tokenizer_class`` can tell the class from the JSON files."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ModelLoadError(
            f"{path}: no tokenizer.json or tokenizer_config.json; the model directory must include its tokenizer"
        )
    try:
        cls = generic_tokenizer_class(path)
        if cls is not None:
            return cls.from_pretrained(str(path), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types here; re-raise as one actionable error
        raise ModelLoadError(f"{path}: could not load the tokenizer: {exc}") from exc


_GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")   # transformers 5's generic fast tokenizer, two names


def _json_object(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def generic_tokenizer_class(model_dir: str | Path) -> type | None:
    """The class ``AutoTokenizer.from_pretrained(model_dir)`` picks, when it is transformers'
    generic fast tokenizer (``TokenizersBackend``) and the JSON files show it; None otherwise
    (then only ``AutoTokenizer`` knows).

    transformers 5's ``AutoTokenizer`` builds the model's config to choose the class, and a
    config class imports ``transformers.activations`` and with it ``torch.distributed.tensor``:
    ~1.2 s of CPU in every worker's start, for a class that ``tokenizer_config.json`` and
    ``config.json`` already give when all of these hold: ``tokenizer.json`` is there; neither
    file names custom code (``auto_map``); the tokenizer's declared class is the generic one;
    the model type is transformers' own, with a config class of its own; and transformers
    registers no tokenizer for the model type, or the generic one
    (``qwen2``'s ``Qwen2Tokenizer`` overrides a generic declaration, and ``mistral``'s
    ``MistralCommonBackend`` may: both are left to ``AutoTokenizer``). transformers 4 reads no
    config when the tokenizer declares its class: ``AutoTokenizer`` is cheap there and used.
    ``tests/unit/test_tokenizer_load.py`` compares both paths' tokenizers on the test models and
    ``tests/integration/test_real_model.py`` on SmolLM2."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        return None
    tok_config, config = _json_object(path / "tokenizer_config.json"), _json_object(path / "config.json")
    if tok_config is None or config is None or "auto_map" in tok_config or "auto_map" in config:
        return None
    declared, model_type = tok_config.get("tokenizer_class"), config.get("model_type")
    if declared not in _GENERIC or not isinstance(model_type, str):
        return None
    try:
        from transformers.models.auto import configuration_auto, tokenization_auto
    except ImportError:
        return None
    backend = getattr(tokenization_auto, "TokenizersBackend", None)
    registered_names = getattr(tokenization_auto, "TOKENIZER_MAPPING_NAMES", None)
    config_classes = configuration_auto.CONFIG_MAPPING_NAMES
    if backend is None or not isinstance(registered_names, dict) or model_type not in config_classes:
        return None
    if list(config_classes.values()).count(config_classes[model_type]) != 1:
        return None   # a config class shared by model types ("gpt-sw3" is GPT2Config): its own type may differ
    registered = registered_names.get(model_type)
    if registered is not None and registered not in _GENERIC:
        return None
    return backend


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a UTF-8 character.

    A fast tokenizer streams through ``tokenizers``' ``DecodeStream``, which holds tokens back
    while they end in half a multi-byte character. ``spaces_between_special_tokens`` (which
    ``DecodeStream`` does not do) and a slow tokenizer decode a short window of recent tokens
    twice per token instead and emit only complete text: when the window's text ends in U+FFFD
    they wait for the next token. Both give the same deltas (SmolLM2's and the test models'
    tokenizers, text and random ids, special tokens skipped or kept); ``DecodeStream`` took
    1.4-2.7 us a token against 8.6-22.5 us for the window (2026-12, 2-core host, loaded).
    Either way ``flush`` ends the stream with what is still held (an incomplete character
    becomes U+FFFD; ``DecodeStream`` alone would drop it).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = False) -> None:
        self._skip_special = skip_special_tokens
        self._tok = tokenizer
        # vLLM's spaces_between_special_tokens: added-vocabulary tokens (the special ones and
        # others such as <tool_call>) are joined to the text around them by one space each.
        self._added: frozenset[int] = (frozenset(tokenizer.get_added_vocab().values())
                                       if spaces_between_special_tokens else frozenset())
        self._special: frozenset[int] = frozenset(tokenizer.all_special_ids) if self._added else frozenset()
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT:]) if prompt_token_ids else []
        # _prefix: where the window starts; _read: tokens before it are already emitted.
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""
        self._backend = None if self._added else getattr(tokenizer, "backend_tokenizer", None)
        self._stream = (None if self._backend is None else
                        DecodeStream(ids=list(self._ids) or None, skip_special_tokens=skip_special_tokens))

    def _decode(self, ids: list[int]) -> str:
        if not self._added or not any(t in self._added for t in ids):
            return self._tok.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)
        pieces: list[str] = []
        run: list[int] = []
        for t in ids:
            if t not in self._added:
                run.append(t)
                continue
            if run:
                pieces.append(self._tok.decode(run, clean_up_tokenization_spaces=False))
                run = []
            if not (self._skip_special and t in self._special):
                pieces.append(self._tok.decode([t], skip_special_tokens=False))
        if run:
            pieces.append(self._tok.decode(run, clean_up_tokenization_spaces=False))
        return " ".join(pieces)

    def push(self, token_ids: list[int]) -> str:
        """Add new tokens; return the text they complete (may be empty)."""
        self._ids.extend(token_ids)
        if self._stream is not None:
            delta = ""
            for i, t in enumerate(token_ids, len(self._ids) - len(token_ids)):
                chunk = self._stream.step(self._backend, t)
                if chunk is not None:
                    delta += chunk
                    self._prefix, self._read = max(0, i + 1 - _CONTEXT), i + 1
            self.text += delta
            return delta
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            delta = full_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a stream, emit whatever is left (an incomplete character becomes U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
