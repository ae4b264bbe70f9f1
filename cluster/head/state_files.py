"""The state directory of ``pdserve up`` (``$PDSERVE_STATE_DIR``, default ``~/.pdserve``) and its files.

* ``head.json``: who the head is (``HeadIdentity``), written before it starts anything, so that
  ``down`` finds what a head that died on the way left running.
* ``state.json``: the same and where it serves (endpoints, Redis URL, Ray address), written once
  it serves; no password.
* ``redis-password``: the head's Redis password for the CLI commands (``status``, ``requests``).
* ``head-overrides-*.json``: ``up``'s ``--set`` values handed to the head it starts, deleted once read.

The directory is 0700 and every file in it 0600: values given with ``--set`` may be secrets. This
module reads and writes files only (no Ray, Redis or config), so ``pdserve status`` and ``down``
stay light.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def state_dir() -> Path:
    return Path(os.environ.get("PDSERVE_STATE_DIR", Path.home() / ".pdserve"))


def state_file() -> Path:
    return state_dir() / "state.json"


def head_file() -> Path:
    """Who the head is (``HeadIdentity``), written before it starts anything: ``state.json``
    appears only once it serves, and a head that dies on the way leaves processes too."""
    return state_dir() / "head.json"


def redis_password_file() -> Path:
    """The head's Redis password for CLI commands (``status``, ``requests``): mode 0600."""
    return state_dir() / "redis-password"


def ensure_state_dir() -> Path:
    """The state directory, created 0700 (and made 0700 if it is ours and open to others)."""
    path = state_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_mode & 0o077:
        if st.st_uid == os.getuid() and not st.st_mode & stat.S_ISVTX:  # never chmod a shared /tmp
            os.chmod(path, 0o700)
        else:
            logger.warning("state directory %s is readable by other users; its files are 0600", path)
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``path`` atomically as a 0600 file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    tmp.replace(path)


def write_redis_password(password: str | None) -> None:
    path = redis_password_file()
    if password is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(password)
    tmp.replace(path)


def give_overrides(overrides: list[str]) -> Path:
    """A 0600 file holding ``up``'s ``--set`` values for the head (see ``take_overrides``)."""
    fd, name = tempfile.mkstemp(prefix="head-overrides-", suffix=".json", dir=ensure_state_dir())
    with os.fdopen(fd, "w", encoding="utf-8") as fh:  # mkstemp creates it 0600
        json.dump(overrides, fh)
    return Path(name)


def take_overrides(path: str | os.PathLike[str]) -> list[str]:
    """The ``--set`` values ``up`` left for this head; the file is deleted once read."""
    file = Path(path)
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    finally:
        file.unlink(missing_ok=True)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{file}: expected a JSON list of KEY=VALUE strings")
    return values


def read_state() -> dict | None:
    try:
        state = json.loads(state_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("pid"), int) else None


def read_head() -> dict | None:
    """The last head's record: ``state.json`` once it served, else ``head.json`` (no endpoints:
    it was still starting, or died before it served)."""
    st = read_state()
    if st is not None:
        return st
    try:
        head = json.loads(head_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return head if isinstance(head, dict) and isinstance(head.get("pid"), int) else None


def remove_state() -> None:
    state_file().unlink(missing_ok=True)
    head_file().unlink(missing_ok=True)
    redis_password_file().unlink(missing_ok=True)
