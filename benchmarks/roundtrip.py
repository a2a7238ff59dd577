"""The store's own loopback round trip, with the driver its provider uses.

A handoff is a few store round trips plus the core's own work (the in-memory store's
handoff measures that alone). Section 1 of the report sets each backend's handoff p50
beside one round trip of the cheapest request its driver can make, timed from the event
loop the way the provider's calls are: Redis ``PING`` (redis.asyncio), PostgreSQL
``SELECT 1`` (psycopg, async, autocommit), an etcd ``get`` of a missing key (aetcd), a
ZooKeeper ``exists`` (kazoo's async API, settled on the event loop from kazoo's thread,
as the provider does), and on the file system one write and fsync of a small file in a
worker thread (the provider's calls run in worker threads; every write it makes is
fsynced). So the reader sees how many round trips a handoff costs, and
whether a missed latency target is bounded by the store or by the code around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from common import summary

SAMPLES = 300
WARMUP = 30

Call = Callable[[], Awaitable[Any]]
Close = Callable[[], Awaitable[Any]]

#: What is timed per backend (the report's wording).
OPERATIONS = {
    "redis": "PING (redis.asyncio)",
    "postgres": "SELECT 1 (psycopg async, autocommit)",
    "etcd": "get of a missing key (aetcd)",
    "zookeeper": "exists('/') (kazoo's async API)",
    "filesystem": "write + fsync of a small file (os, in a worker thread)",
}


async def measure(name: str, url: str, samples: int = SAMPLES) -> dict[str, Any] | None:
    """p50/p95/p99 (ms) of *samples* sequential round trips to *name*'s store; None: n/a."""
    opener = _OPENERS.get(name)
    if opener is None:
        return None
    call, close = await opener(url)
    try:
        for _ in range(WARMUP):
            await call()
        latencies = []
        for _ in range(samples):
            began = time.perf_counter()
            await call()
            latencies.append((time.perf_counter() - began) * 1000)
    finally:
        await close()
    return {"operation": OPERATIONS[name], **summary(latencies, 0)}


async def _redis(url: str) -> tuple[Call, Close]:
    from redis.asyncio import Redis

    client = Redis.from_url(url, socket_timeout=5)
    return client.ping, client.aclose


async def _postgres(url: str) -> tuple[Call, Close]:
    import psycopg

    conn = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=10)

    async def select_one() -> Any:
        cursor = await conn.execute("SELECT 1")
        return await cursor.fetchone()

    return select_one, conn.close


async def _etcd(url: str) -> tuple[Call, Close]:
    import aetcd  # type: ignore[import-untyped]

    parts = urlsplit(url)
    client = aetcd.Client(host=parts.hostname or "127.0.0.1", port=parts.port or 2379, timeout=5)
    return lambda: client.get(b"multilock-bench-round-trip"), client.close


async def _zookeeper(url: str) -> tuple[Call, Close]:
    from kazoo.client import KazooClient  # type: ignore[import-untyped]

    parts = urlsplit(url)
    client = KazooClient(hosts=f"{parts.hostname or '127.0.0.1'}:{parts.port or 2181}")
    await asyncio.to_thread(client.start, 10)
    loop = asyncio.get_running_loop()

    async def exists() -> Any:
        future: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any) -> None:  # on kazoo's thread
            try:
                value = result.get(block=False)
            except Exception as exc:
                loop.call_soon_threadsafe(future.set_exception, exc)
            else:
                loop.call_soon_threadsafe(future.set_result, value)

        client.exists_async("/").rawlink(settle)
        async with asyncio.timeout(10):
            return await future

    async def close() -> None:
        await asyncio.to_thread(client.stop)
        await asyncio.to_thread(client.close)

    return exists, close


async def _filesystem(url: str) -> tuple[Call, Close]:
    path = os.path.join(urlsplit(url).path, f"multilock-round-trip-{uuid.uuid4().hex}")

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            os.write(fd, b'{"holder": "round trip"}')
            os.fsync(fd)
        finally:
            os.close(fd)

    async def close() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    return lambda: asyncio.to_thread(write), close


_OPENERS: dict[str, Callable[[str], Awaitable[tuple[Call, Close]]]] = {
    "redis": _redis,
    "postgres": _postgres,
    "etcd": _etcd,
    "zookeeper": _zookeeper,
    "filesystem": _filesystem,
}
