"""TagPosition: where a tool-call output is (free text or inside a call's JSON), from token bytes.
The control-byte ban of JSON holds inside a call only, so it must see the tags exactly."""

from __future__ import annotations

from pdserve.engine.structured import TagPosition

VOCAB = [b"Hi", b"\n", b"<tool", b"_call>", b"<tool_call>", b'{"a": 1', b"}</tool_call>", b"}</to", b"ol_call>",
         b" more\n", b'"x"']


def walk(tokens: list[int]) -> list[bool]:
    pos = TagPosition(["<tool_call>"], ["}</tool_call>"], VOCAB)
    seen = []
    for t in tokens:
        pos.push(t)
        seen.append(pos.inside)
    return seen


def test_a_trigger_opens_a_tag_and_its_end_closes_it():
    assert walk([0, 1, 4, 5, 6, 9]) == [False, False, True, True, False, False]


def test_a_trigger_or_an_end_split_across_tokens_is_seen():
    assert walk([2, 3, 5, 7, 8, 1]) == [False, True, True, True, False, False]


def test_one_token_holding_a_whole_call_leaves_the_tag_closed():
    pos = TagPosition(["<tool_call>"], ["}</tool_call>"], [b'x<tool_call>{"a": 1}</tool_call>y'])
    pos.push(0)
    assert pos.inside is False


def test_a_second_call_opens_again_and_a_matched_trigger_is_not_matched_twice():
    assert walk([4, 5, 6, 4, 10]) == [True, True, False, True, True]


def test_an_id_outside_the_vocabulary_changes_nothing():
    assert walk([4, 99, 6]) == [True, True, False]
