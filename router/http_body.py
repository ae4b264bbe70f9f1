"""Reading an HTTP request's JSON body, so that every malformed body is a 4xx that says what to fix.

1. ``Content-Type`` must be ``application/json`` (a ``charset`` parameter, if any, utf-8);
   anything else, or none, is 415. This also keeps web pages out: a browser sends a
   cross-origin POST without asking first only as a form or text/plain ("simple" request).
2. ``Content-Encoding`` may be ``identity``, ``gzip`` (``x-gzip``) or ``deflate``; others are 415.
3. The body must arrive within ``timeout_s`` (408), be at most ``max_bytes`` on the wire and
   again once decompressed (413); a corrupt or truncated compressed body is 400.
4. UTF-8, then JSON: a syntax error, an integer over Python's digit limit (4,300 digits),
   nesting deeper than the parser's recursion limit, or an escaped unpaired surrogate
   (``"\\ud800"``, which no tokenizer can encode) is 400.

The server runs with aiohttp's own decompression off (``auto_decompress=False``): it would
ignore unknown codings and decompress without a size bound.
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib

from aiohttp import web

from pdserve.router.errors import (
    BodyTimeoutError,
    InvalidParameterError,
    RequestTooLargeError,
    UnsupportedMediaTypeError,
)

JSON_TYPE = "application/json"
_ZLIB_FORMATS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_content_type(request: web.Request) -> None:
    """Raise 415 unless the body is declared as JSON in UTF-8."""
    if "Content-Type" not in request.headers:
        raise UnsupportedMediaTypeError(f"the request has no Content-Type; send the header "
                                        f"'Content-Type: {JSON_TYPE}' with a JSON body")
    if request.content_type != JSON_TYPE:
        hint = (" (curl -d sends that: add -H 'content-type: application/json')"
                if request.content_type == "application/x-www-form-urlencoded" else "")
        raise UnsupportedMediaTypeError(f"Content-Type must be {JSON_TYPE}, got {request.content_type[:64]!r}"
                                        f"{hint}")
    charset = (request.charset or "utf-8").lower()
    if charset not in ("utf-8", "utf8"):
        raise UnsupportedMediaTypeError(f"the body must be UTF-8 JSON, got charset {charset[:32]!r}; "
                                        f"send 'Content-Type: {JSON_TYPE}' or '{JSON_TYPE}; charset=utf-8'")


def _coding(request: web.Request) -> str:
    codings = [c.strip().lower() for c in request.headers.get("Content-Encoding", "").split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    if not codings:
        return "identity"
    if len(codings) > 1 or codings[0] not in _ZLIB_FORMATS:
        raise UnsupportedMediaTypeError(
            f"Content-Encoding {request.headers['Content-Encoding'][:64]!r} is not supported; "
            "send the body uncompressed, or compressed once with gzip or deflate")
    return codings[0]


def _decompress(raw: bytes, coding: str, max_bytes: int) -> bytes:
    wbits = _ZLIB_FORMATS[coding]
    if coding == "deflate" and raw and (raw[0] & 0x0F) != 8:
        wbits = -zlib.MAX_WBITS  # raw deflate without the zlib header, as some clients send it
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(raw, max_bytes + 1)
    except zlib.error as exc:
        raise InvalidParameterError(f"the {coding} body is corrupt ({exc}); "
                                    "send it uncompressed or compress it again") from None
    if len(out) > max_bytes:
        raise RequestTooLargeError(f"the request body is larger than {max_bytes} bytes once decompressed")
    if not inflater.eof or inflater.unused_data:
        raise InvalidParameterError(f"the {coding} body is truncated or has bytes after its end; "
                                    "send the complete compressed body")
    return out


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The decoded body bytes (checks 2 and 3 of the module docstring)."""
    coding = _coding(request)
    if request.content_length is not None and request.content_length > max_bytes:
        raise RequestTooLargeError(f"the request body ({request.content_length} bytes) is larger than "
                                   f"the {max_bytes} bytes this server accepts")
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyTimeoutError(f"the request body did not arrive within {timeout_s:g} s; "
                               "send the whole body at once") from None
    return raw if coding == "identity" else _decompress(raw, coding, max_bytes)


def parse_json(raw: bytes) -> object:
    """The JSON value of a UTF-8 body (check 4 of the module docstring)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidParameterError(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidParameterError("the request body is nested too deeply; "
                                    "JSON arrays and objects may nest a few hundred levels") from None
    except ValueError as exc:  # an integer past sys.get_int_max_str_digits()
        raise InvalidParameterError(f"the request body has a number this server cannot read: "
                                    f"{str(exc)[:120]}") from None
    if _SURROGATE_ESCAPE.search(text):  # only an escape can put a surrogate into valid UTF-8 text
        _refuse_surrogates(value)
    return value


def _refuse_surrogates(value: object) -> None:
    """Raise 400 naming the field if any string (or key) holds an unpaired surrogate."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                where = f" in '{path[:64]}'" if path else ""
                raise InvalidParameterError(
                    f"the request body has an unpaired surrogate escape (\\ud800-\\udfff){where}; "
                    "strings must be valid Unicode (escape a character outside the BMP as a pair)",
                    param=path.split(".")[0].split("[")[0] or None)
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, path))
                stack.append((child, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
