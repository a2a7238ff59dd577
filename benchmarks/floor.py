"""The driver's floor: the same notified handoff written directly on the driver, no library.

A multilock handoff on a notifying store is three steps in a row: the leader's release
(one write that also notifies), the store's notification reaching the follower, and the
follower's acquire (one write). This module times exactly those steps with the driver
the provider uses and nothing else: no election, no validation, no bounded calls, no
event stream. Both clients share one event loop and one process, as the two elections of
section 1 do, and each handoff starts after the same pause (``GAP``) so the server and
the client are as idle as they are there. The difference between the multilock handoff
and this floor is what the library itself adds; the floor is what the store, the driver
and this machine's wake-ups cost.

Per store:

- Redis (redis.asyncio): a Lua script deletes the key and PUBLISHes; the follower's
  pub/sub connection receives it and runs ``SET key NX PX``.
- PostgreSQL (psycopg async, autocommit): one statement deletes the row and calls
  ``pg_notify``; the follower's LISTEN connection receives it and runs one
  ``INSERT .. ON CONFLICT DO UPDATE .. WHERE expired`` on its own connection.
- etcd (aetcd): the leader revokes its lease (the key goes with it); the follower's watch
  sees the DELETE, grants a lease and runs one create-if-absent transaction.
- The file system (`os`, in worker threads as the provider's calls run): the leader, under
  an exclusive ``flock``, reads the record and renames over it the free record it wrote
  and fsynced when its term began (untimed, as the provider writes it 10 ms into a term);
  the directory's inotify descriptor, read by the event loop, wakes the follower, which
  under the lock reads the record, writes and fsyncs a temp file, renames it and fsyncs
  the directory (its token rose). The fsyncs are the durability every handoff on a file
  system must pay: a record that survives a power cut whole, and a token that never goes
  back.
- ZooKeeper (kazoo's asynchronous API from the event loop, its callbacks run on its
  connection thread and hop to the loop, as the provider's do): the follower's node is
  already queued behind the leader's, with an exists watch on it, as in kazoo's recipes;
  the leader deletes its node and the follower leads once that watch's event reaches the
  loop. No acquire follows: the next node in line leads with no further request (kazoo's
  ``Election`` lists the children first, one more round trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import queue
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from common import summary

#: The pause before each handoff (seconds): about what section 1 leaves between two.
GAP = 0.025
#: Handoffs before the timed ones (connections and scripts warm).
WARMUP = 5

#: What is timed per backend (the report's wording).
OPERATIONS = {
    "redis": "script DEL + PUBLISH, pub/sub, SET NX PX (redis.asyncio)",
    "postgres": "DELETE + pg_notify, LISTEN, INSERT .. ON CONFLICT (psycopg async)",
    "etcd": "lease revoke, watch, lease grant + create-if-absent txn (aetcd)",
    "filesystem": "flock + rename of a free record written ahead; inotify; flock + write, "
    "fsync, rename, fsync of the directory (os, worker threads)",
    "zookeeper": "delete of the leader's node; the next node's exists watch (kazoo async API)",
}

#: A leader's setup, a timed handoff (returns when the follower holds), the clean-up.
Round = Callable[[], Awaitable[None]]


async def measure(name: str, url: str, samples: int) -> dict[str, Any] | None:
    """p50/p95/p99 (ms) of *samples* raw handoffs on *name*'s store; None: not defined."""
    opener = _OPENERS.get(name)
    if opener is None:
        return None
    take, hand_over, close = await opener(url)
    latencies: list[float] = []
    failures = 0
    try:
        for round_ in range(WARMUP + samples):
            await take()
            await asyncio.sleep(GAP)
            began = time.perf_counter()
            try:
                async with asyncio.timeout(5):
                    await hand_over()
            except TimeoutError:
                failures += round_ >= WARMUP
                continue
            if round_ >= WARMUP:
                latencies.append((time.perf_counter() - began) * 1000)
    finally:
        await close()
    return {"operation": OPERATIONS[name], **summary(latencies, failures)}


async def _redis(url: str) -> tuple[Round, Round, Round]:
    from redis.asyncio import Redis

    leader, follower = Redis.from_url(url), Redis.from_url(url)
    key, channel = f"multilock-floor-{uuid.uuid4().hex}", f"multilock-floor-{uuid.uuid4().hex}"
    release = leader.register_script(
        "if redis.call('del', KEYS[1]) == 1 then redis.call('publish', KEYS[2], 'released') end"
    )
    pubsub = follower.pubsub()
    await pubsub.subscribe(channel)
    await pubsub.get_message(timeout=5)  # the subscribe confirmation
    won: asyncio.Queue[bool] = asyncio.Queue()

    async def listen() -> None:
        while True:
            message = await pubsub.get_message(timeout=None)
            if message is not None and message["type"] == "message":
                won.put_nowait(bool(await follower.set(key, "follower", nx=True, px=2000)))

    listener = asyncio.create_task(listen())

    async def take() -> None:
        await leader.set(key, "leader", px=2000)

    async def hand_over() -> None:
        await release(keys=[key, channel])
        if not await won.get():
            raise RuntimeError("the follower's SET NX found the key held")

    async def close() -> None:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await leader.delete(key)
        await leader.aclose()
        await follower.aclose()

    return take, hand_over, close


async def _postgres(url: str) -> tuple[Round, Round, Round]:
    import psycopg

    table = f"multilock_floor_{uuid.uuid4().hex[:12]}"
    leader = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=10)
    follower = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=10)
    listening = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=10)
    await leader.execute(
        f"CREATE TABLE {table} (name text PRIMARY KEY, holder text, expires_at timestamptz)"
    )
    await listening.execute(f"LISTEN {table}")
    won: asyncio.Queue[bool] = asyncio.Queue()
    acquire = (
        f"INSERT INTO {table} AS t VALUES ('g', 'follower', clock_timestamp() + interval '2 s')"
        " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder,"
        " expires_at = excluded.expires_at"
        " WHERE t.holder IS NULL OR t.expires_at <= clock_timestamp() RETURNING t.holder"
    )

    async def listen() -> None:
        async for _ in listening.notifies():
            cursor = await follower.execute(acquire)  # type: ignore[arg-type]
            won.put_nowait(await cursor.fetchone() is not None)

    listener = asyncio.create_task(listen())

    async def take() -> None:
        await leader.execute(
            f"INSERT INTO {table} VALUES ('g', 'leader', clock_timestamp() + interval '2 s')"  # type: ignore[arg-type]
            " ON CONFLICT (name) DO UPDATE SET holder = 'leader', expires_at = excluded.expires_at"
        )

    async def hand_over() -> None:
        await leader.execute(
            f"WITH d AS (UPDATE {table} SET holder = NULL WHERE name = 'g' AND holder = 'leader'"  # type: ignore[arg-type]
            f" RETURNING name) SELECT pg_notify('{table}', name) FROM d"
        )
        if not await won.get():
            raise RuntimeError("the follower's INSERT found the row held")

    async def close() -> None:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await leader.execute(f"DROP TABLE {table}")  # type: ignore[arg-type]
        for conn in (leader, follower, listening):
            await conn.close()

    return take, hand_over, close


async def _etcd(url: str) -> tuple[Round, Round, Round]:
    import aetcd  # type: ignore[import-untyped]

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 2379
    leader = aetcd.Client(host=host, port=port, timeout=5)
    follower = aetcd.Client(host=host, port=port, timeout=5)
    key = f"multilock-floor/{uuid.uuid4().hex}".encode()
    leases: dict[str, Any] = {}  # who holds the key: its lease
    armed = asyncio.Event()  # a timed handoff is on: the next DELETE is the leader's
    won: asyncio.Queue[bool] = asyncio.Queue()
    tx = follower.transactions
    stream = await follower.watch(key)

    async def listen() -> None:
        async for event in stream:
            if event.kind == "DELETE" and armed.is_set():
                armed.clear()
                lease = leases["follower"] = await follower.lease(2)
                ok, _ = await follower.transaction(
                    compare=[tx.create(key) == 0],
                    success=[tx.put(key, b"follower", lease=lease.id)],
                    failure=[],
                )
                won.put_nowait(bool(ok))

    listener = asyncio.create_task(listen())

    async def take() -> None:
        lease = leases.pop("follower", None)
        if lease is not None:
            await follower.revoke_lease(lease.id)
        lease = leases["leader"] = await leader.lease(2)
        await leader.put(key, b"leader", lease=lease.id)

    async def hand_over() -> None:
        armed.set()
        await leader.revoke_lease(leases.pop("leader").id)
        if not await won.get():
            raise RuntimeError("the follower's txn found the key held")

    async def close() -> None:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await stream.cancel()
        await leader.close()
        await follower.close()

    return take, hand_over, close


#: inotify(7): a file renamed into the watched directory.
IN_MOVED_TO = 0x80


def _write_record(
    directory: str, name: str, holder: bytes, *, free: bool, durable: bool, ahead: bool = False
) -> bool:
    """Under the group's flock: read the record; unless the holder must be *free* and is
    not, write it through a temp file (fsynced) renamed over it, then with *durable* fsync
    the directory; with *ahead*, then write and fsync the free record the release will
    rename. Returns whether it wrote."""
    path = os.path.join(directory, name)
    lock = os.open(f"{path}.lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path, "rb") as f:
                current = f.read()
        except FileNotFoundError:
            current = b""
        if free and current not in (b"", b"free"):
            return False
        _write_synced(f"{path}.tmp", holder)
        os.replace(f"{path}.tmp", path)
        if ahead:
            _write_synced(f"{path}.free", b"free")
        if durable:
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return True
    finally:
        os.close(lock)  # drops the flock


def _write_synced(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _release_ahead(directory: str, name: str) -> None:
    """Under the group's flock: read the record, rename the free one written ahead over it."""
    path = os.path.join(directory, name)
    lock = os.open(f"{path}.lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(path, "rb") as f:
            f.read()
        os.replace(f"{path}.free", path)
    finally:
        os.close(lock)  # drops the flock


async def _filesystem(url: str) -> tuple[Round, Round, Round]:
    directory = urlsplit(url).path
    name = f"multilock-floor-{uuid.uuid4().hex}"
    libc = ctypes.CDLL(None, use_errno=True)
    inotify = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if inotify < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    if libc.inotify_add_watch(inotify, os.fsencode(directory), IN_MOVED_TO) < 0:
        error = ctypes.get_errno()
        os.close(inotify)
        raise OSError(error, "inotify_add_watch")
    loop = asyncio.get_running_loop()
    armed = asyncio.Event()  # a timed handoff is on: the next rename is the leader's release
    won: asyncio.Queue[bool] = asyncio.Queue()
    header = struct.Struct("iIII")
    tasks: set[asyncio.Task[None]] = set()

    async def acquire() -> None:
        won.put_nowait(
            await asyncio.to_thread(
                _write_record, directory, name, b"follower", free=True, durable=True
            )
        )

    def on_readable() -> None:
        names: set[bytes] = set()
        with contextlib.suppress(BlockingIOError):
            while data := os.read(inotify, 65536):
                offset = 0
                while offset < len(data):
                    _, _, _, length = header.unpack_from(data, offset)
                    offset += header.size
                    names.add(data[offset : offset + length].rstrip(b"\0"))
                    offset += length
        if name.encode() in names and armed.is_set():
            armed.clear()
            task = asyncio.create_task(acquire())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    loop.add_reader(inotify, on_readable)

    async def take() -> None:
        await asyncio.to_thread(
            _write_record, directory, name, b"leader", free=False, durable=True, ahead=True
        )

    async def hand_over() -> None:
        armed.set()
        await asyncio.to_thread(_release_ahead, directory, name)
        if not await won.get():
            raise RuntimeError("the follower found the record held")

    async def close() -> None:
        loop.remove_reader(inotify)
        os.close(inotify)
        await asyncio.gather(*tasks, return_exceptions=True)
        for suffix in ("", ".lock", ".tmp", ".free"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, name + suffix))

    return take, hand_over, close


async def _zookeeper(url: str) -> tuple[Round, Round, Round]:
    from kazoo.client import KazooClient  # type: ignore[import-untyped]
    from kazoo.handlers.threading import (  # type: ignore[import-untyped]
        SequentialThreadingHandler,
    )

    class Inline(queue.Queue[Any]):
        """kazoo's callback queue, run as filled on the connection thread (as the provider
        has it): the callbacks below only hop to the loop."""

        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            item() if callable(item) else super().put(item, block, timeout)

    class Handler(SequentialThreadingHandler):  # type: ignore[misc]
        queue_impl = Inline

    loop = asyncio.get_running_loop()
    hosts = urlsplit(url).netloc
    leader, follower = KazooClient(hosts, handler=Handler()), KazooClient(hosts, handler=Handler())
    await asyncio.gather(*(asyncio.to_thread(c.start, 10) for c in (leader, follower)))
    root = f"/multilock-floor-{uuid.uuid4().hex}"

    def reply(sent: Any) -> asyncio.Future[Any]:
        done: asyncio.Future[Any] = loop.create_future()

        def settle() -> None:
            if sent.successful():
                done.set_result(sent.value)
            else:
                done.set_exception(sent.exception)

        sent.rawlink(lambda _: loop.call_soon_threadsafe(settle))
        return done

    await reply(leader.ensure_path_async(root))
    nodes: dict[str, str] = {}  # who holds which node
    woken: list[asyncio.Future[Any]] = []

    async def take() -> None:
        if "follower" in nodes:
            await reply(follower.delete_async(nodes.pop("follower")))
        nodes["leader"] = await reply(
            leader.create_async(f"{root}/n-", ephemeral=True, sequence=True)
        )
        nodes["follower"] = await reply(
            follower.create_async(f"{root}/n-", ephemeral=True, sequence=True)
        )
        event: asyncio.Future[Any] = loop.create_future()

        def fired(watched: Any) -> None:
            loop.call_soon_threadsafe(lambda: event.done() or event.set_result(watched.type))

        if await reply(follower.exists_async(nodes["leader"], watch=fired)) is None:
            raise RuntimeError("the leader's node is gone before the handoff")
        woken[:] = [event]

    async def hand_over() -> None:
        deleted = reply(leader.delete_async(nodes.pop("leader")))
        if await woken[0] != "DELETED":
            raise RuntimeError(f"the follower's watch saw {woken[0].result()}, not DELETED")
        await deleted

    async def close() -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(leader.delete, root, recursive=True)
        for client in (leader, follower):
            await asyncio.to_thread(client.stop)
            await asyncio.to_thread(client.close)

    return take, hand_over, close


_OPENERS: dict[str, Callable[[str], Awaitable[tuple[Round, Round, Round]]]] = {
    "redis": _redis,
    "postgres": _postgres,
    "etcd": _etcd,
    "filesystem": _filesystem,
    "zookeeper": _zookeeper,
}
