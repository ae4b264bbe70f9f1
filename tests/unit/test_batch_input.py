"""The Batch API's pure checks (``router/batch_input.py``) and its tenants' owner ids
(``router/auth.py``): JSONL split on ``\\n`` only, nesting depth read before parsing, unpaired
surrogates refused, ids and filenames bounded, one owner per configured key however the header
spells it."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.errors import AuthenticationError
from pdserve.router import batch_api, batch_input
from pdserve.engine.structured import json_depth
from pdserve.router.auth import ANONYMOUS, ApiKeyAuth, owner_id
from pdserve.router.errors import InvalidParameterError, RequestTooLargeError

URL = "/v1/completions"


def line(custom_id: str, prompt: str = "hi", **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL,
                       "body": {"model": "m", "prompt": prompt, **extra}}, ensure_ascii=False)


def nested(depth: int) -> str:
    """A request line whose arrays nest ``depth`` levels (its own object adds two)."""
    return line("deep").replace('"hi"', "[" * depth + "]" * depth)


# ------------------------------------------------------------------- lines
@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\u0085", "\x1c", "\x0b", "\x0c"])
def test_a_line_holding_a_character_splitlines_splits_on_is_one_line(sep: str) -> None:
    text = line("a", f"one{sep}two") + "\n" + line("b") + "\r\n\n"
    assert len(text.splitlines()) > 2 or sep in "\x0b\x0c"  # the old bug
    items, problems = batch_input.check_lines(text.encode(), URL)
    assert problems == [] and len(items) == 2
    assert json.loads(items[0])["body"]["prompt"] == f"one{sep}two"


def test_line_numbers_are_the_files_own_blank_lines_included() -> None:
    text = "\n".join([line("a"), "", "{broken", line("a")])
    items, problems = batch_input.check_lines(text.encode(), URL)
    assert [(p["line"], p["code"]) for p in problems] == [(3, "invalid_json"), (4, "duplicate_custom_id")]


def test_depth_is_read_without_parsing_and_strings_do_not_count() -> None:
    assert json_depth('{"a": [1, {"b": []}]}') == 4
    assert json_depth('"[[[[" ') == 0
    assert json_depth('{"a": "[[[[\\"[[[", "b": [[]]}') == 3
    assert json_depth("[" * 5000 + "]" * 5000, limit=10_000) == 5000
    assert not batch_input.too_deep(nested(batch_input.MAX_JSON_DEPTH - 2))
    assert batch_input.too_deep(nested(batch_input.MAX_JSON_DEPTH + 1))


def test_a_line_nested_5000_deep_is_refused_at_upload_and_at_creation_naming_the_limit() -> None:
    deep = nested(5000)
    content = (line("ok") + "\n" + deep + "\n").encode()
    with pytest.raises(InvalidParameterError, match=f"line 2 .*more than {batch_input.MAX_JSON_DEPTH} levels"):
        batch_input.check_file(content)
    items, problems = batch_input.check_lines(content, URL)   # a file stored before the upload check
    assert [(p["line"], p["code"]) for p in problems] == [(2, "invalid_json")]
    assert str(batch_input.MAX_JSON_DEPTH) in problems[0]["message"]


@pytest.mark.parametrize("where", ["custom_id", "prompt", "key"])
def test_an_unpaired_surrogate_anywhere_in_a_line_is_refused(where: str) -> None:
    good = line("a")
    bad = {"custom_id": line("x").replace('"x"', '"\\ud800"'),
           "prompt": line("b").replace('"hi"', '"a\\udfffb"'),
           "key": line("c").replace('"prompt"', '"\\udc00"')}[where]
    content = (good + "\n" + bad + "\n").encode()
    with pytest.raises(InvalidParameterError, match="line 2 has an unpaired surrogate"):
        batch_input.check_file(content)
    items, problems = batch_input.check_lines(content, URL)
    assert [(p["line"], p["code"]) for p in problems] == [(2, "invalid_request")]
    # a surrogate pair is a valid character
    pair = line("d").replace('"hi"', '"\\ud83d\\ude00"')
    batch_input.check_file(pair.encode())
    assert batch_input.check_lines(pair.encode(), URL)[1] == []


def test_uploads_are_bounded_and_say_by_what() -> None:
    with pytest.raises(InvalidParameterError, match="10000 characters; at most 255"):
        batch_input.check_filename("x" * 10_000)
    assert batch_input.check_filename("a.jsonl") == "a.jsonl" and batch_input.check_filename(None) == "upload.jsonl"
    with pytest.raises(RequestTooLargeError):
        batch_input.check_upload("batch", b"x" * (batch_input.MAX_FILE_BYTES + 1))
    with pytest.raises(InvalidParameterError, match="not UTF-8"):
        batch_input.check_file(b"\xff\xfe")
    too_long = line("big", "x" * (batch_input.MAX_LINE_BYTES + 1))
    assert batch_input.check_lines(too_long.encode(), URL)[1][0]["message"].startswith("the line is longer")
    many = "\n".join(line(f"m{i}") for i in range(batch_input.MAX_LINES + 1)).encode()
    assert [p["code"] for p in batch_input.check_lines(many, URL)[1]] == ["too_many_requests"]
    batch_input.check_file(many)   # the upload takes it; a batch cannot


@pytest.mark.parametrize("value,ok", [("batch_" + "0" * 32, True), ("batch_" + "a" * 32 + ":counts", False),
                                      ("batch_" + "a" * 31, False), ("batch_" + "A" * 32, False),
                                      ("batch_x:items", False), ("", False), ("batch_" + "f" * 32 + "\n", False)])
def test_batch_ids_are_checked_before_they_reach_a_key(value: str, ok: bool) -> None:
    assert batch_input.is_batch_id(value) is ok
    assert batch_input.is_file_id(value.replace("batch_", "file-")) is ok


# ------------------------------------------------------------------ owners
def test_each_key_is_one_owner_however_the_header_spells_it() -> None:
    auth = ApiKeyAuth(["key-a", " key-b "])
    a = auth.check("Bearer key-a")
    assert a == auth.check("bearer  key-a") == auth.check("  BEARER key-a  ") == owner_id("key-a")
    b = auth.check("Bearer key-b")
    assert b == owner_id("key-b") and a != b
    assert "key-a" not in a and len(a) == 32
    for header in (None, "", "Bearer", "Bearer key-c", "Basic key-a", "Bearer key-a2"):
        with pytest.raises(AuthenticationError):
            auth.check(header)


def test_without_keys_everyone_is_the_anonymous_owner() -> None:
    auth = ApiKeyAuth()
    assert auth.check(None) == auth.check("Bearer anything") == ANONYMOUS


def test_objects_stored_before_owners_belong_to_the_anonymous_owner_only() -> None:
    legacy = {"id": "batch_" + "0" * 32, "status": "completed"}
    assert batch_api.owned_by(legacy, ANONYMOUS) and not batch_api.owned_by(legacy, owner_id("k"))
    mine = batch_api.new_batch("file-" + "0" * 32, URL, "24h", None, 3, owner_id("k"))
    assert batch_api.owned_by(mine, owner_id("k")) and not batch_api.owned_by(mine, ANONYMOUS)
    assert not batch_api.owned_by(None, ANONYMOUS)
    assert "owner" not in batch_api.batch_object(mine)
    assert "owner" not in batch_api.file_object(batch_api.new_file(b"x", "f", "batch", owner_id("k")))


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1 << 20])
def test_lines_read_in_slices_are_the_lines_read_at_once(size: int) -> None:
    text = "\r\n".join([line("a", "x\u2028y"), "", "  ", line("b"), "{broken", line("c") + "\r"]) + "\n\n" + line("d")
    content = text.encode()
    slices = [content[i:i + size] for i in range(0, len(content), size)]
    whole = list(batch_input.iter_lines(content))
    assert list(batch_input.iter_lines(slices)) == whole
    assert [n for n, _ in whole] == [1, 4, 5, 6, 8]
    assert whole[-1][1] == line("d").encode() and whole[0][1] == line("a", "x\u2028y").encode()
    assert batch_input.check_lines(slices, URL) == batch_input.check_lines(content, URL)


def test_a_line_longer_than_one_request_is_named_without_being_copied_whole() -> None:
    big = b"x" * (batch_input.MAX_LINE_BYTES + 10)
    content = line("a").encode() + b"\n" + big + b"\n" + line("b").encode()
    for slices in ([content], [content[i:i + 4096] for i in range(0, len(content), 4096)]):
        assert [(n, x is None) for n, x in batch_input.iter_lines(slices)] == [(1, False), (2, True), (3, False)]


def test_the_request_log_keeps_the_owner_and_the_operators_view_shows_it() -> None:
    from pdserve.cluster.cli.requests_cmd import format_request
    from pdserve.engine.contract import RequestRecord

    rec = RequestRecord("r1", "cid-1", "batch", "length", owner=owner_id("k"))
    logged = rec.to_dict()
    assert logged["owner"] == owner_id("k") and RequestRecord.from_dict(logged).owner == owner_id("k")
    assert f"owner {owner_id('k')}" in format_request(logged)
    anonymous = RequestRecord("r2", "", "http", "stop").to_dict()
    assert "owner" not in anonymous and "owner" not in format_request(anonymous)
