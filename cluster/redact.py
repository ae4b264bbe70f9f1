"""Keeping secrets out of what pdserve prints and writes: passwords inside URLs.

``SecretStr`` fields (API keys, ``redis.password``) mask themselves; a password an operator
writes into ``redis.url`` (``redis://:pw@host:6379/0``) does not, so everything that shows a
URL passes it through ``redact_url``, and the head splits it off with ``split_password``
before the URL goes into ``state.json``.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "**********"  # what pydantic shows for a SecretStr


def _netloc(user: str | None, password: str | None, host: str) -> str:
    if user is None and password is None:
        return host
    return f"{user or ''}{':' + password if password is not None else ''}@{host}"


def _parts(url: str):  # -> (SplitResult, userinfo-less host part) or None when there is no userinfo
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if "@" not in parts.netloc:
        return None
    return parts, parts.netloc.rpartition("@")[2]


def redact_url(url: str) -> str:
    """``url`` with the password of its userinfo (if any) replaced by ``MASK``."""
    found = _parts(url)
    if found is None:
        return url
    parts, host = found
    if parts.password is None:
        return url  # only a user name: nothing secret
    return urlunsplit(parts._replace(netloc=_netloc(parts.username, MASK, host)))


def split_password(url: str) -> tuple[str, str | None]:
    """``(url without its password, the password, percent-decoded)``; ``(url, None)`` when it has none."""
    found = _parts(url)
    if found is None or found[0].password is None:
        return url, None
    parts, host = found
    bare = urlunsplit(parts._replace(netloc=_netloc(parts.username or None, None, host)))
    return bare, unquote(parts.password) or None
