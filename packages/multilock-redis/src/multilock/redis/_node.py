"""`Node`: one Redis server as both providers use it.

Every call goes through `DriverCalls`: bounded by a timeout (cancelling a redis-py call
drops its connection, so nothing half-read is reused), and every failure becomes
`ProviderError` with no credential in its message or chain. The node's listener watches
every group on one pub/sub connection (a pattern subscription), and remembers from each
message when the group's lease ends, so a woken watch need not ask the server. Calls
that write go in batches (`Batches`): renewals once per loop turn in one pipeline;
acquires and releases at once when none of their kind is on its way, and those asked for
meanwhile in one pipeline right after it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
    NoScriptError,
    RedisError,
)

from multilock.core.provider import (
    Batches,
    DriverCalls,
    LeaderInfo,
    ProviderError,
    raise_if_cancelled,
    redact_url,
    scrub,
)

from . import _scripts
from ._config import Settings, check_pool_size, client_from_url, sentinel_client

T = TypeVar("T")

__all__ = ["Granted", "Node", "encode_metadata", "lease_ms"]

log = logging.getLogger(__name__)
#: One script call: its keys and its arguments.
_Script = tuple[list[str], list[str | int]]
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Groups whose lease end a node remembers (about 100 bytes each); past that it forgets them
#: all (a hint only saves a PTTL read). Above the 10,000 groups one process may lead.
_MAX_HINTS = 65536
_UNKNOWN = object()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _time(microseconds: Any) -> datetime:
    return _EPOCH + timedelta(microseconds=int(_text(microseconds)))


def encode_metadata(metadata: Mapping[str, str]) -> str:
    return json.dumps(dict(metadata), ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def lease_ms(lease_duration: float) -> int:
    """Milliseconds for PX, rounded up: a server lease is never shorter than asked."""
    return max(1, math.ceil(lease_duration * 1000))


@attrs.frozen
class Granted:
    """What one node's acquire script gave: the token of the new lease and when it began."""

    token: int
    acquired_at: datetime
    #: With ``wait_replicas``: how many replicas acknowledged the lease (WAIT's answer).
    replicas: int | None = None


class _Calls(DriverCalls):
    """`DriverCalls` that also cut the secrets of the node's URL from messages, say when
    the server refused the credentials, and queue commands for the pool's connections in
    a FIFO of their own.

    A refused password is not "cannot reach the server": its message says so, names the
    server once, and tells a missing password from a wrong one (*authenticated*: the
    URL or client gives credentials).

    redis-py's blocking pool makes every waiter take and give back one condition lock:
    with thousands of elections waiting (a process leading 10,000 groups starting up),
    each connection handed back waits behind them all, the client spins at 100 % of a
    core and the server sees a few commands a second. A semaphore sized to the pool
    (less one connection kept for the pub/sub listener) lets only as many commands reach
    the pool as it has connections; the rest wait here in O(1), bounded by the caller's
    own deadline (the election's ``call_until``). Renewals and releases go first
    (`Slots`): when more calls come than the client can send, the terms already won keep
    their leases, instead of waiting behind the campaigns of those that lost theirs, which
    would make them lose theirs too. So does a batch of acquires (one at a time), which
    answers many callers with one connection.
    """

    def __init__(
        self,
        where: str,
        timeout: float,
        url: str | None,
        secrets: Sequence[str],
        slots: int,
        *,
        authenticated: bool,
    ):
        super().__init__(
            "redis", where, timeout=timeout, failures=(RedisError, OSError), secrets=secrets
        )
        self._url = url
        self._slots = Slots(max(1, slots))
        self._authenticated = authenticated

    def scrub(self, text: str) -> str:
        text = super().scrub(text)
        return text if self._url is None else scrub(text, self._url)

    def error(self, op: str, exc: BaseException) -> ProviderError:
        error = super().error(op, exc)
        if isinstance(exc, AuthenticationWrongNumberOfArgsError):
            what = "takes a password only, no user name (Redis before 6)"
        elif isinstance(exc, AuthenticationError):
            what = (
                "refused the credentials"
                if self._authenticated
                else "requires a password, and none was given"
            )
        elif isinstance(exc, NoPermissionError):
            what = "refused a command to this user (its ACL does not allow it)"
        else:
            return error
        detail = self.scrub(str(exc).strip()) or type(exc).__name__
        specific = ProviderError(
            f"redis {op} failed: the Redis server at {self.where} {what}: {detail}"
        )
        specific.__cause__ = error.__cause__  # None if the driver's error held a secret
        specific.__suppress_context__ = True
        return specific

    async def call(
        self, op: str, call: Awaitable[T], *, limit: float | None = None, slot: bool = True
    ) -> T:
        """One driver call; *slot*: it takes a pool connection (a queued renewal does
        not: the pipeline that sends it takes one for all)."""
        if not slot:
            return await super().call(op, call, limit=limit)
        try:
            await self._slots.acquire(first=op in _FIRST)
        except BaseException:
            if isinstance(call, Coroutine):
                call.close()
            raise
        try:
            return await super().call(op, call, limit=limit)
        finally:
            self._slots.release()

    def slot(self, *, first: bool = True) -> _Slot:
        """A pool connection for a batch; *first*: before every other call (renewals and
        releases, which keep won terms)."""
        return _Slot(self._slots, first)


class _Slot:
    """`Slots` as an async context manager (a plain class: it is entered on every call)."""

    __slots__ = ("_first", "_slots")

    def __init__(self, slots: Slots, first: bool) -> None:
        self._slots, self._first = slots, first

    async def __aenter__(self) -> None:
        await self._slots.acquire(first=self._first)

    async def __aexit__(self, *exc: object) -> None:
        self._slots.release()


#: The calls that keep a won term: they take a free connection before any other call.
_FIRST = frozenset({"renew", "release"})


class Slots:
    """A semaphore with two FIFO queues: a waiter asking to go *first* is served before
    every other waiter. A slot given back goes straight to the next waiter; one given to
    a waiter cancelled before it resumed goes on to the next."""

    def __init__(self, size: int) -> None:
        self.free = size
        self._queues: tuple[collections.deque[asyncio.Future[None]], ...] = (
            collections.deque(),
            collections.deque(),
        )

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._queues)

    async def acquire(self, *, first: bool = False) -> None:
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues[0 if first else 1]
        queue.append(slot)
        try:
            await slot
        except BaseException:
            if slot.done() and not slot.cancelled():
                self.release()  # handed over as the caller left: to the next one
            else:
                with contextlib.suppress(ValueError):
                    queue.remove(slot)
            raise

    def release(self) -> None:
        for queue in self._queues:
            while queue:
                slot = queue.popleft()
                if not slot.done():
                    slot.set_result(None)
                    return
        self.free += 1


def _slots(client: Redis) -> int:
    """Commands that may hold a pooled connection at once: the pool less one for pub/sub."""
    limit = getattr(client.connection_pool, "max_connections", None)
    return 2**31 if not isinstance(limit, int) else limit - 1


class Node:
    """One Redis server: a client (closed only if this node built it), scripts and keys."""

    def __init__(
        self,
        client: Redis,
        calls: _Calls,
        *,
        owned: bool,
        settings: Settings,
        closers: Sequence[Callable[[], Awaitable[Any]]] = (),
        check: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.client = client
        self.calls = calls
        self.label = calls.where
        self.prefix = settings.key_prefix
        self.settings = settings
        #: Behind Sentinel: asks the sentinels which node is the master before each write.
        self._check = check
        self._owned = owned
        self._closers = [client.aclose, *closers] if owned else []
        self._acquire = client.register_script(_scripts.ACQUIRE)
        self._renew = client.register_script(_scripts.RENEW)
        self._release = client.register_script(_scripts.RELEASE)
        self._commit = client.register_script(_scripts.COMMIT)
        #: group -> when its lease ends on the loop's clock (None: released), as the last
        #: message said. Kept only while the listener is subscribed.
        self._hints: dict[str, float | None] = {}
        self._reading: dict[str, asyncio.Future[float | None]] = {}
        #: Renewals asked for in one loop turn go in one pipeline, on a connection taken
        #: before other calls' (`Slots`): one send and one reply read for all of them.
        self._renewals: Batches[_Script, Any] = Batches(
            self._renew_many, timeout=calls.timeout, slot=calls.slot
        )
        #: Acquires and releases go at once when none of their kind is on its way, alone
        #: (the plain script: a handoff's pays no pipeline); those asked for meanwhile go
        #: together in one pipeline after it, before other calls waiting for a connection
        #: (one batch of each kind at a time, so they cannot crowd out the rest). A
        #: process starting 10,000 elections sends a few pipelines, not 10,000 scripts
        #: that queue for the pool's connections behind its watches' first reads.
        self._acquires: Batches[_Script, Any] = Batches(
            functools.partial(self._run_many, self._acquire),
            timeout=calls.timeout,
            slot=calls.slot,
            eager=True,
        )
        self._releases: Batches[_Script, Any] = Batches(
            functools.partial(self._run_many, self._release),
            timeout=calls.timeout,
            slot=calls.slot,
            eager=True,
        )
        #: The watches' reads of a lease's end (PTTL) likewise: 10,000 watches opening at
        #: once send a few pipelines.
        self._pttls: Batches[str, Any] = Batches(
            self._pttl_many,
            timeout=calls.timeout,
            slot=functools.partial(calls.slot, first=False),
            eager=True,
        )

    @classmethod
    def build(
        cls,
        target: str | Redis,
        settings: Settings,
        sentinel_kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Node:
        """A node for a URL (this node owns the client it builds) or a caller's client.

        *timeout* bounds one call (default: connect + command timeouts).
        """
        timeout = timeout or settings.connect_timeout + settings.socket_timeout
        if isinstance(target, Redis):
            check_pool_size(getattr(target.connection_pool, "max_connections", None))
            kwargs = target.connection_pool.connection_kwargs
            password = kwargs.get("password") or ""
            where = (
                f"{kwargs.get('host', 'redis')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
            )
            authenticated = bool(password or kwargs.get("credential_provider"))
            calls = _Calls(
                where,
                timeout,
                None,
                [password, unquote(password)],
                _slots(target),
                authenticated=authenticated,
            )
            return cls(target, calls, owned=False, settings=settings)
        closers: list[Callable[[], Awaitable[Any]]] = []
        check: Callable[[], Awaitable[None]] | None = None
        if urlsplit(target).scheme == "redis+sentinel":
            client, close_sentinels, check = sentinel_client(target, settings, sentinel_kwargs)
            closers.append(close_sentinels)
        else:
            client = client_from_url(target, settings)
        parts = urlsplit(target)
        given = {k for k, _ in parse_qsl(parts.query)}
        authenticated = parts.password is not None or bool(parts.username) or "password" in given
        calls = _Calls(
            redact_url(target), timeout, target, (), _slots(client), authenticated=authenticated
        )
        return cls(client, calls, owned=True, settings=settings, closers=closers, check=check)

    def _keys(self, group: str) -> tuple[str, str, str]:
        p = self.prefix
        return (
            _scripts.lease_key(p, group),
            _scripts.token_key(p, group),
            _scripts.channel_name(p, group),
        )

    async def _write(
        self, script: AsyncScript, keys: list[str], args: list[str | int], lease_ms: int
    ) -> tuple[Any, int | None]:
        """Run a script that starts or extends a term; return its reply, and with
        ``wait_replicas`` how many replicas acknowledged it (``WAIT``, else None).

        Behind Sentinel, the sentinels are asked first which node is the master (the
        write goes there, or nowhere if none answers). ``WAIT`` counts the replicas that
        have the connection's last write, so it goes in one pipeline with the script, on
        the same connection: a retry after a broken connection resends both.
        """
        if self._check is not None:
            await self._check()
        wanted = self.settings.wait_replicas
        if not wanted:
            return await script(keys=keys, args=args), None
        for loaded in (False, True):
            pipe = self.client.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            pipe.wait(wanted, self.settings.wait_ms(lease_ms))
            reply, replicas = await pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError) and not loaded:
                # A new master (a failover) or a restart has an empty script cache.
                script.sha = await self.client.script_load(script.script)
                continue
            break
        for result in (reply, replicas):
            if isinstance(result, Exception):
                raise result
        return reply, int(replicas)

    async def acquire(
        self,
        group: str,
        participant_id: str,
        lease_ms: int,
        metadata: str,
        *,
        candidate: int = 0,
        clock_floor: bool,
        attempt: str = "",
        within: float | None = None,
    ) -> Granted | None:
        """Create a lease if none is live here; None while one is (whoever holds it)."""
        lease, counter, channel = self._keys(group)
        args: list[str | int] = [
            participant_id, lease_ms, metadata, candidate, int(clock_floor), channel, attempt,
        ]  # fmt: skip
        if self.settings.wait_replicas:
            write = self._write(self._acquire, [lease, counter], args, lease_ms)
            reply, replicas = await self.calls.call("acquire", write, limit=within)
        else:
            reply = await self._queued("acquire", self._acquires(([lease, counter], args)), within)
            replicas = None
        if not reply:
            return None
        token, acquired_at = reply
        return Granted(int(_text(token)), _time(acquired_at), replicas)

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_ms: int,
        metadata: str,
        within: float | None = None,
    ) -> bool:
        """Extend the participant's lease with *token*; False if it is not live here.

        With ``wait_replicas``, a renewal fewer replicas acknowledged raises
        `ProviderError`: the term must not count on it (a failover may lose it).
        """
        lease, _, _ = self._keys(group)
        args: list[str | int] = [participant_id, token, lease_ms, metadata]
        sent = asyncio.get_running_loop().time()
        wanted = self.settings.wait_replicas
        if wanted:
            write = self._write(self._renew, [lease], args, lease_ms)
            reply, replicas = await self.calls.call("renew", write, limit=within)
        else:
            reply = await self._queued("renew", self._renewals(([lease], args)), within)
            replicas = None
        renewed = int(reply) == 1
        if renewed:
            # A renewal publishes nothing: note the lease's new end (no earlier than this)
            # for the watches here, the leader's own among them, which would else read
            # PTTL once per lease when the end they last heard of comes.
            self._note(group, sent + lease_ms / 1000)
        if renewed and replicas is not None and replicas < wanted:
            raise ProviderError(
                f"redis renew of {group!r} on {self.label}: only {replicas} of the "
                f"{wanted} replicas asked for acknowledged it within "
                f"{self.settings.wait_ms(lease_ms)} ms (wait_replicas): not counted"
            )
        return renewed

    async def _queued(self, op: str, queued: Awaitable[T], within: float | None) -> T:
        """A call sent in a batch (`Batches`), within *within* seconds if given; else the
        batches bound it: the batch on its way when it was asked for, then its own, each
        within the call timeout (slot wait and send), however large. A herd's callers
        (10,000 elections starting) then wait for the batch that answers them, instead of
        leaving one timeout after asking while it is on its way, and asking again."""
        if within is None:
            return await self.calls.batched(op, queued)
        return await self.calls.call(op, queued, limit=within, slot=False)

    async def _renew_many(self, calls: list[_Script]) -> list[Any]:
        """The RENEW script's replies for a batch of renewals, in one pipeline (`Batches`)."""
        if self._check is not None:
            await self._check()
        return await self._pipeline(self._renew, calls)

    async def _run_many(self, script: AsyncScript, calls: list[_Script]) -> list[Any]:
        """*script*'s replies for a batch of acquires or releases (`Batches`): one alone
        runs the script itself, more go in one pipeline. Behind Sentinel, the sentinels
        are asked first which node is the master (the acquires go there, or nowhere)."""
        if self._check is not None and script is self._acquire:
            await self._check()
        if len(calls) == 1:
            keys, args = calls[0]
            return [await script(keys=keys, args=args)]
        return await self._pipeline(script, calls)

    async def _pipeline(self, script: AsyncScript, calls: list[_Script]) -> list[Any]:
        """Run *script* once per (keys, args) in one pipeline; each reply or its error."""
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for loaded in (False, True):
            pipe = self.client.pipeline(transaction=False)
            for i in todo:
                keys, args = calls[i]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            for i, reply in zip(todo, await pipe.execute(raise_on_error=False), strict=True):
                replies[i] = reply
            todo = [i for i in todo if isinstance(replies[i], NoScriptError)]
            if not todo or loaded:
                break
            # A new master (a failover) or a restart has an empty script cache.
            script.sha = await self.client.script_load(script.script)
        return replies

    async def release(
        self,
        group: str,
        participant_id: str,
        token: int,
        *,
        attempt: str = "",
        within: float | None = None,
    ) -> bool:
        """Delete the participant's lease with *token*, or with *attempt* (any token) if given."""
        lease, _, channel = self._keys(group)
        queued = self._releases(([lease], [participant_id, token, channel, attempt]))
        return int(await self._queued("release", queued, within)) == 1

    async def commit(
        self, group: str, participant_id: str, given: int, token: int, within: float | None
    ) -> bool:
        lease, counter, _ = self._keys(group)
        script = self._commit(keys=[lease, counter], args=[participant_id, given, token])
        return int(await self.calls.call("commit", script, limit=within)) == 1

    async def leader(self, group: str, within: float | None = None) -> LeaderInfo | None:
        """The holder of the group's lease here; a key with PX is live by definition."""
        lease, _, _ = self._keys(group)
        read = self.client.hmget(lease, ["participant", "token", "metadata", "acquired_at"])
        reply = await self.calls.call("get_leader", read, limit=within)
        if reply[0] is None:
            return None
        try:
            participant, token, metadata, acquired_at = (_text(v) for v in reply)
            meta = json.loads(metadata)
            if not isinstance(meta, dict):
                raise ValueError("metadata is not an object")
            return LeaderInfo(
                participant_id=participant,
                token=int(token),
                metadata={str(k): str(v) for k, v in meta.items()},
                acquired_at=_time(acquired_at),
            )
        except (ValueError, TypeError, AttributeError) as exc:
            raise ProviderError(f"malformed lease record {lease!r} on {self.label}") from exc

    async def expires_in(self, group: str) -> float | None:
        """Seconds the group's lease has left here, None if there is none.

        The last message on the group's channel, or the last renewal sent from here,
        answers without a round trip while it holds: "released" (until a new term
        publishes), or a lease not yet due. Past that (a renewal publishes nothing, so
        another process's is not seen), PTTL reads it.
        """
        hint = self._hints.get(group, _UNKNOWN)
        if hint is None:
            return None
        if isinstance(hint, float):
            left = hint - asyncio.get_running_loop().time()
            if left > 0:
                return left
        # The watches of one group share a read in flight: a thousand of them woken at
        # once (a reconnect, an expiry) send one PTTL, not a thousand.
        reading = self._reading.get(group)
        if reading is None or reading.done():
            reading = self._reading[group] = asyncio.ensure_future(self._pttl(group))
            reading.add_done_callback(functools.partial(self._read, group))
        return await asyncio.shield(reading)

    def _read(self, group: str, reading: asyncio.Future[float | None]) -> None:
        if self._reading.get(group) is reading:
            del self._reading[group]
        if not reading.cancelled():
            reading.exception()  # retrieved, even when every watch waiting for it is gone

    async def _pttl(self, group: str) -> float | None:
        lease, _, _ = self._keys(group)
        ms = int(await self._queued("pttl", self._pttls(lease), None))
        return ms / 1000 if ms >= 0 else None  # -1: no expiry, -2: no lease

    async def _pttl_many(self, keys: list[str]) -> list[Any]:
        """PTTL of each key (`Batches`): one alone, more in one pipeline."""
        if len(keys) == 1:
            return [await self.client.pttl(keys[0])]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.pttl(key)
        return await pipe.execute(raise_on_error=False)

    def _remember(self, channel: Any, data: Any) -> tuple[str, str, str] | None:
        """The group a message's *channel* names, the message's kind (``acquired``,
        ``released``) and its attempt id ("" for none), after noting what *data* says of
        the group."""
        name, start = _text(channel), len(self.prefix) + 1
        if not name.endswith(_scripts.CHANGED) or len(name) <= start + len(_scripts.CHANGED):
            return None
        group = name[start : -len(_scripts.CHANGED)]
        kind, _, rest = _text(data).partition(" ")
        if kind == "released":
            self._note(group, None)
            return group, kind, rest
        ms, _, attempt = rest.partition(" ")
        if kind == "acquired" and ms.isdigit():
            self._note(group, asyncio.get_running_loop().time() + int(ms) / 1000)
        else:
            self._hints.pop(group, None)
        return group, kind, attempt

    def _note(self, group: str, ends: float | None) -> None:
        """Note when *group*'s lease ends here (None: released), for `expires_in`."""
        if len(self._hints) >= _MAX_HINTS and group not in self._hints:
            self._hints.clear()
        self._hints[group] = ends

    async def listen(
        self, ready: Callable[[], None], notify: Callable[[str, str, str], None]
    ) -> None:
        """Subscribe once to every group's channel, then report: `ready`, and
        ``notify(group, kind, attempt)`` for each message (*kind*: ``acquired``,
        ``released``; *attempt*: the Redlock attempt that made the lease, "" for none).

        Runs until cancelled or the connection breaks (`ProviderError`). redis-py
        reconnects a dropped connection once and subscribes again, which calls `ready`.
        """
        pubsub = self.client.pubsub()
        self._hints.clear()
        try:
            pattern = _scripts.channel_pattern(self.prefix)
            await self.calls.call("subscribe", pubsub.psubscribe(pattern))
            while True:
                raise_if_cancelled()  # else, cancelled as it subscribed, it waits for ever
                failure: BaseException | None = None
                try:
                    message = await pubsub.get_message(timeout=None)
                except self.calls.failures as exc:
                    failure = exc  # raised below, outside the handler: no secret as context
                if failure is not None:
                    self.calls.fail("subscription", failure)
                if message is None:
                    continue
                if message["type"] == "psubscribe":
                    self._hints.clear()  # messages may have been missed
                    ready()
                elif message["type"] == "pmessage":
                    event = self._remember(message["channel"], message["data"])
                    if event is not None:
                        notify(*event)
        finally:
            self._hints.clear()
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def aclose(self) -> None:
        if self.calls.closed:
            return
        self.calls.closed = True
        for batches in (self._acquires, self._renewals, self._releases, self._pttls):
            await batches.aclose()
        for close in self._closers:
            try:
                await close()
            except Exception as exc:  # closing is best effort: the server may be gone
                log.debug("closing %s: %r", self.label, exc)
