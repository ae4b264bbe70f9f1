"""Pytest fixtures for a real Redis-protocol server shared by one test session.

Import into ``tests/conftest.py``::

    from redis_fixture import redis_server, redis_url, redis_client, redis_namespace  # noqa: F401

- ``redis_server`` (session): one password-protected ``EmbeddedRedis`` on 127.0.0.1.
- ``redis_namespace``: a key prefix unique to the test; its keys are deleted afterwards.
- ``redis_client``: a fresh pdserve client (``connect``) for the test, closed afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from pdserve.cluster.state.redis_server import EmbeddedRedis, connect


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(password=f"pw-{uuid.uuid4().hex[:12]}")
    server.start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.is_running()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = connect(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def redis_namespace(redis_url: str) -> Iterator[str]:
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    yield namespace
    cleaner = connect(redis_url)
    try:
        keys = list(cleaner.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            cleaner.delete(*keys)
    finally:
        cleaner.close()
