"""The router's output text: incremental, UTF-8 safe, stop strings cut and never leaked."""

from __future__ import annotations

import pytest

from pdserve.engine.output_text import OutputText


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from pdserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stream(out: OutputText, ids: list[int]) -> list[str]:
    deltas = [out.push(t) for t in ids]
    if not out.stopped:
        deltas.append(out.finish())
    return deltas


def test_multibyte_characters_are_never_split(tokenizer) -> None:
    text = " naïve café — 世界 🎉 done"
    ids = ids_of(tokenizer, text)
    assert len(ids) > len(text.split())  # some characters span several byte tokens
    deltas = stream(OutputText(tokenizer, ids_of(tokenizer, "Say:")), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_string_spanning_tokens_is_cut_and_ends_the_text(tokenizer) -> None:
    text = " the quick brown fox jumps over the lazy dog"
    ids = ids_of(tokenizer, text)
    out = OutputText(tokenizer, [], stop=("n fox j",))
    deltas = stream(out, ids)
    assert out.stopped
    assert "".join(deltas) == " the quick brow" == out.text
    assert out.push(ids[-1]) == "" and out.finish() == ""


def test_possible_stop_prefix_is_held_back_then_released(tokenizer) -> None:
    out = OutputText(tokenizer, [], stop=("fox!",))
    deltas = [out.push(t) for t in ids_of(tokenizer, " a fox")]
    assert "".join(deltas) == " a "  # "fox" might start "fox!": not shown yet
    deltas += [out.push(t) for t in ids_of(tokenizer, " ran")]
    deltas.append(out.finish())
    assert "".join(deltas) == " a fox ran" and not out.stopped


def test_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    out = OutputText(tokenizer, [], stop=("dog", "over"))
    text = "".join(stream(out, ids_of(tokenizer, " jumps over the lazy dog")))
    assert text == " jumps "


def test_no_stop_strings_streams_everything(tokenizer) -> None:
    text = " plain text, nothing special."
    assert "".join(stream(OutputText(tokenizer, []), ids_of(tokenizer, text))) == text


def test_include_stop_str_keeps_the_stop_string_and_nothing_after_it(tokenizer) -> None:
    ids = ids_of(tokenizer, " the quick brown fox jumps over the lazy dog")
    out = OutputText(tokenizer, [], stop=("n fox j", "lazy"), include_stop_str=True)
    assert "".join(stream(out, ids)) == " the quick brown fox j" and out.stopped


def test_special_tokens_are_skipped_unless_asked_for(tokenizer) -> None:
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = ids_of(tokenizer, " hi") + [special] + ids_of(tokenizer, " there")
    assert "".join(stream(OutputText(tokenizer, []), ids)) == " hi there"
    assert "".join(stream(OutputText(tokenizer, [], skip_special_tokens=False), ids)) == " hi<|im_start|> there"


def test_decode_stream_gives_the_window_decoders_deltas(tokenizer) -> None:
    """``DecodeStream`` (fast tokenizers) and the window decoder (spaces_between_special_tokens,
    slow tokenizers) agree delta for delta, on ids that split characters and hold specials."""
    import random

    from pdserve.engine.tokenizer import IncrementalDetokenizer

    rng = random.Random(0)
    cases = [ids_of(tokenizer, " naïve café — 世界 🎉 done")]
    cases += [[rng.randrange(8) if rng.random() < 0.2 else rng.randrange(len(tokenizer)) for _ in range(120)]
              for _ in range(10)]
    for ids in cases:
        for skip in (True, False):
            streamed = IncrementalDetokenizer(tokenizer, ids_of(tokenizer, "Say:"), skip)
            window = IncrementalDetokenizer(tokenizer, ids_of(tokenizer, "Say:"), skip)
            assert streamed._stream is not None
            window._stream = None
            assert ([streamed.push([t]) for t in ids] + [streamed.flush()]
                    == [window.push([t]) for t in ids] + [window.flush()])
    held = IncrementalDetokenizer(tokenizer, [])
    first_byte = ids_of(tokenizer, "世")[:1]   # half of a character: held, then flushed as U+FFFD
    assert len(ids_of(tokenizer, "世")) > 1
    assert held.push(first_byte) == "" and held.flush() == "\ufffd"
