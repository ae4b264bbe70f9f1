"""The Batch API's input checks: uploads, input files' lines and the ids that reach Redis keys.

Plain functions on bytes and strings (no I/O), so that the router runs them off its event loop
(``asyncio.to_thread``) and the unit tests run them alone. Life of an input file:

1. Upload (``check_upload``, then ``check_file`` off the loop): purpose ``batch``, not empty, at
   most ``MAX_FILE_BYTES``, a filename of at most ``MAX_FILENAME_CHARS``; UTF-8 text whose
   lines nest at most ``MAX_JSON_DEPTH`` levels and hold no unpaired surrogate (``"\\ud800"``,
   which no tokenizer, log or Redis client can encode): anything else is a 400 naming the line
   and the limit, and nothing is stored.
2. Batch creation (``check_lines``, off the loop): each line must be one request for the
   batch's endpoint; a line that is not (too long, too deep, not JSON, a duplicate
   ``custom_id``...) fails the batch as OpenAI's does, each bad line named. Files stored before
   step 1 existed meet the same checks here.

Lines are split on ``\\n`` only (a ``\\r`` before it is dropped): JSON strings may hold U+2028,
U+0085 and the other characters that ``str.splitlines`` would split on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator

from pdserve.engine.structured import json_depth
from pdserve.router import errors
from pdserve.router.errors import InvalidParameterError

MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_LINES = 50_000
MAX_LINE_BYTES = 4 * 1024 * 1024      # one request, as the HTTP API's default body limit
MAX_JSON_DEPTH = 64                   # arrays and objects nested in one line
MAX_FILENAME_CHARS = 255
MAX_CUSTOM_ID_CHARS = 512

_BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")
_FILE_ID = re.compile(r"file-[0-9a-f]{32}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _bad(param: str | None, message: str) -> InvalidParameterError:
    return InvalidParameterError(message, param=param)


def is_batch_id(value: str) -> bool:
    """Whether ``value`` has the shape of an id this server gives batches (checked before any
    id is put into a Redis key: ``batch_x:counts`` would otherwise name another key)."""
    return _BATCH_ID.fullmatch(value) is not None


def is_file_id(value: str) -> bool:
    return _FILE_ID.fullmatch(value) is not None


def iter_lines(content: bytes | Iterable[bytes]) -> Iterator[tuple[int, bytes | None]]:
    """The non-blank lines of a JSONL file (its bytes, or its bytes in slices) with their 1-based
    line numbers, split on ``\\n`` only (a ``\\r`` before it dropped); None for a line longer than
    ``MAX_LINE_BYTES``. Each line is cut out on its own: no step holds the GIL for the whole
    file (a 64 MiB ``decode`` or ``split`` does, which stalls the event loop even from a thread)."""
    n = 0
    parts: list[bytes] = []     # the line so far, when it spans slices
    length = 0
    overlong = False
    for chunk in (content,) if isinstance(content, bytes) else content:
        pos, size = 0, len(chunk)
        while pos < size:
            end = chunk.find(b"\n", pos)
            stop = size if end < 0 else end
            if overlong or length + stop - pos > MAX_LINE_BYTES + 1:
                overlong, parts, length = True, [], 0
            else:
                parts.append(chunk[pos:stop])
                length += stop - pos
            if end < 0:
                break
            n += 1
            line = _whole_line(parts, overlong)
            if line is not False:
                yield n, line
            parts, length, overlong = [], 0, False
            pos = end + 1
    if parts or overlong:
        line = _whole_line(parts, overlong)
        if line is not False:
            yield n + 1, line


def _whole_line(parts: list[bytes], overlong: bool) -> bytes | None | bool:
    """A line from its parts: None when too long, False when blank."""
    if overlong:
        return None
    line = parts[0] if len(parts) == 1 else b"".join(parts)
    if line.endswith(b"\r"):
        line = line[:-1]
    return line if line.strip() else False


def too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests deeper than ``limit`` (cheap when it has few brackets)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    return json_depth(text, limit) > limit


def has_lone_surrogate(value: object) -> bool:
    """Whether a parsed JSON value holds a string (or key) with an unpaired surrogate."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _line_has_lone_surrogate(line: str) -> bool:
    """Whether a JSON line's value holds an unpaired surrogate; False for a line that is not
    JSON (creation names that). Only a ``\\uD8xx`` escape can put one into UTF-8 text."""
    if not _SURROGATE_ESCAPE.search(line):
        return False
    try:
        return has_lone_surrogate(json.loads(line))
    except (ValueError, RecursionError):
        return False


def check_filename(filename: str | None) -> str:
    """The upload's filename, or a 400 naming the limit."""
    if filename is None or not filename.strip():
        return "upload.jsonl"
    if len(filename) > MAX_FILENAME_CHARS:
        raise _bad("file", f"the filename has {len(filename)} characters; at most {MAX_FILENAME_CHARS} are accepted")
    return filename


def check_upload(purpose: str | None, content: bytes) -> None:
    if purpose != "batch":
        raise _bad("purpose", f"'purpose' must be \"batch\" (the only kind of file this server keeps), got {purpose!r}")
    if not content:
        raise _bad("file", "the file is empty; send a JSONL file with one request per line")
    if len(content) > MAX_FILE_BYTES:
        raise errors.RequestTooLargeError(f"the file is {len(content)} bytes; at most {MAX_FILE_BYTES} are accepted")


def check_file(content: bytes | Iterable[bytes]) -> None:
    """An uploaded file's text (step 1 of the module docstring): 400 naming the first line that
    is not UTF-8, nests deeper than ``MAX_JSON_DEPTH`` or holds an unpaired surrogate."""
    for n, raw in iter_lines(content):
        if raw is None:
            continue   # too long for one request: creation names it
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _bad("file", f"line {n} is not UTF-8 text (its byte {exc.start})") from None
        if too_deep(line):
            raise _bad("file", f"line {n} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep "
                               f"(the limit); flatten the request")
        if _line_has_lone_surrogate(line):
            raise _bad("file", f"line {n} has an unpaired surrogate escape (\\ud800-\\udfff); strings must be "
                               "valid Unicode (escape a character outside the BMP as a pair)")


def check_lines(content: bytes | Iterable[bytes], endpoint: str) -> tuple[list[str], list[dict]]:
    """The input file's request lines, or the errors of the lines that are not valid requests for
    ``endpoint`` (OpenAI's shape: ``code``, ``message``, ``line``, 1-based). CPU-bound: run it
    off the event loop."""
    found: list[dict] = []
    seen: set[str] = set()
    items: list[str] = []
    count = 0
    for n, raw in iter_lines(content):
        count += 1
        if count > MAX_LINES:
            return [], [{"code": "too_many_requests", "message": f"the file has more than {MAX_LINES} requests, "
                         "the most that fit one batch", "param": None, "line": n}]

        def err(code: str, message: str, param: str | None = None) -> None:
            found.append({"code": code, "message": message, "param": param, "line": n})
        if raw is None or len(raw) > MAX_LINE_BYTES:
            err("invalid_request", f"the line is longer than {MAX_LINE_BYTES} bytes (the limit for one request)")
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            err("invalid_file", "the line is not UTF-8 text")
            continue
        if too_deep(line):
            err("invalid_json", f"the line nests arrays and objects more than {MAX_JSON_DEPTH} levels deep (the limit)")
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            err("invalid_json", "the line is not valid JSON")
            continue
        if not isinstance(obj, dict):
            err("invalid_request", "the line must be a JSON object")
            continue
        if has_lone_surrogate(obj):
            err("invalid_request", "the line has an unpaired surrogate escape (\\ud800-\\udfff); strings must be "
                "valid Unicode")
            continue
        unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
        cid = obj.get("custom_id")
        if unknown:
            err("invalid_request", f"unknown field '{str(unknown[0])[:64]}'", unknown[0])
        elif not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID_CHARS:
            err("missing_required_parameter", f"'custom_id' must be a non-empty string (at most "
                f"{MAX_CUSTOM_ID_CHARS} characters)", "custom_id")
        elif cid in seen:
            err("duplicate_custom_id", f"the custom_id '{cid[:64]}' is used by an earlier line; each must be unique",
                "custom_id")
        elif obj.get("method") != "POST":
            err("invalid_request", "'method' must be \"POST\"", "method")
        elif obj.get("url") != endpoint:
            err("invalid_url", f"'url' must be this batch's endpoint {endpoint}, got {str(obj.get('url'))[:64]!r}",
                "url")
        elif not isinstance(obj.get("body"), dict):
            err("invalid_request", "'body' must be a JSON object (the request)", "body")
        else:
            seen.add(cid)
            items.append(line)
    if not items and not found:
        found.append({"code": "empty_file", "message": "the file has no requests", "param": None, "line": None})
    return items, found
