"""Whether two loaded tokenizers behave the same: what pdserve asks of a tokenizer (encode, decode,
special tokens, added vocabulary, chat template) compared on texts that reach the awkward cases."""

from __future__ import annotations

import random

TEXTS = (
    "",
    "Hello, world!",
    " the quick brown fox jumps over the lazy dog\n\n  indented\tand tabbed ",
    " naïve café — 世界 🎉 done",                      # multi-byte characters, split into byte tokens
    "Здравствуй, мир. مرحبا 안녕하세요",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",  # special tokens in text
    "<|begin_of_text|><|end_of_text|><|pad|><|endoftext|>",
    "x" * 300,
)
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France? 🇫🇷"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?"},
]


def _chat(tok, **kwargs) -> object:
    out = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"]) if hasattr(out, "keys") else out


def assert_same_tokenizer(ours, reference, *, seed: int = 0) -> None:
    """``ours`` behaves as ``reference`` on everything the engine and the router use."""
    assert type(ours) is type(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.init_kwargs == reference.init_kwargs     # what tokenizer_config.json and the loader set
    assert len(ours) == len(reference)
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.get_added_vocab() == reference.get_added_vocab()
    assert ours.all_special_ids == reference.all_special_ids
    assert ours.all_special_tokens == reference.all_special_tokens
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "pad_token_id",
                 "padding_side", "truncation_side", "model_max_length", "clean_up_tokenization_spaces",
                 "chat_template"):
        assert getattr(ours, name) == getattr(reference, name), name
    ids_seen: list[int] = []
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special), (text, special)
            assert ours(text, add_special_tokens=special)["input_ids"] == ids
            ids_seen.extend(ids)
    rng = random.Random(seed)
    samples = [ids_seen, list(range(min(len(reference), 300))),
               [rng.randrange(len(reference)) for _ in range(400)]]
    for ids in samples:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    if reference.chat_template is not None:
        assert _chat(ours, tokenize=False) == _chat(reference, tokenize=False)
        assert _chat(ours, tokenize=True) == _chat(reference, tokenize=True)
