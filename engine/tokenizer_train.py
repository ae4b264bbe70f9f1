"""Train and write the byte-level BPE tokenizer of the generated test models.

The tokenizer is trained with the ``tokenizers`` library on ``engine/data/corpus.txt`` (shipped
with the package), so generating a model never touches the network. Training is deterministic:
the same corpus and vocabulary size give a byte-identical ``tokenizer.json``.

Conventions (both are what a Llama-3 / Qwen2 checkpoint does):

* ids 0-4 are the special tokens ``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (eos),
  ``<|im_start|>``, ``<|im_end|>`` and ``<|pad|>``; ``len(tokenizer)`` equals the vocabulary size.
* ``with_bos=True`` (llama): ``encode`` prepends bos (a post-processor template, mirrored by
  ``add_bos_token`` in ``tokenizer_config.json``) and the chat template starts with bos, so a
  rendered chat prompt must be encoded with ``add_special_tokens=False``.
  ``with_bos=False`` (qwen2): nothing is ever prepended.
* Every UTF-8 string round-trips: ``decode(encode(s, add_special_tokens=False)) == s``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

# Pre-tokenizer split: contractions, words (with one leading non-letter such as a space),
# numbers in groups of at most three digits, punctuation runs, then whitespace runs.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

_CHAT_TEMPLATE_BODY = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True, slots=True)
class SpecialTokenIds:
    """Ids of the special tokens, as written into config.json and generation_config.json."""

    bos: int
    eos: int
    im_start: int
    im_end: int
    pad: int


def chat_template(with_bos: bool) -> str:
    """ChatML template (``<|im_start|>role\\ncontent<|im_end|>\\n``); optionally bos first."""
    return ("{{- bos_token -}}" if with_bos else "") + _CHAT_TEMPLATE_BODY


def corpus_digest(corpus_path: Path = CORPUS_PATH) -> str:
    """Short sha256 of the training corpus, so a changed corpus changes cache keys."""
    return hashlib.sha256(corpus_path.read_bytes()).hexdigest()[:16]


def train_tokenizer(vocab_size: int, *, with_bos: bool, corpus_path: Path = CORPUS_PATH) -> Tokenizer:
    """Train a byte-level BPE with at most ``vocab_size`` ids (special tokens included).

    Merges go by pair count, so the first ~4,300 ids of the shipped corpus come from pairs seen at
    least twice and later ones (needed for 8192) from pairs seen once; the corpus supports at most
    ~9,900 ids, and the result is smaller than asked beyond that. Use
    ``get_vocab_size(with_added_tokens=True)`` for the real size.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 512:
        raise ValueError(f"vocab_size must be >= 512, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_path.read_text(encoding="utf-8")
    # Paragraph-sized pieces keep line breaks inside the training data.
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if with_bos:
        template = processors.TemplateProcessing(
            single=f"{BOS_TOKEN}:0 $A:0",
            pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, tok.token_to_id(BOS_TOKEN))],
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    return tok


def special_token_ids(tok: Tokenizer) -> SpecialTokenIds:
    """Look up the special tokens' ids in a trained tokenizer."""
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if any(i is None for i in ids):
        raise ValueError("tokenizer lacks one of the special tokens")
    return SpecialTokenIds(*ids)


def _dump(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(out_dir: Path, tok: Tokenizer, *, with_bos: bool, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``."""
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    specials = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }
    _dump(out_dir / "special_tokens_map.json", specials)
    _dump(
        out_dir / "tokenizer_config.json",
        {
            **specials,
            "added_tokens_decoder": added,
            "add_bos_token": with_bos,
            "add_eos_token": False,
            "chat_template": chat_template(with_bos),
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": model_max_length,
            "padding_side": "left",
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
