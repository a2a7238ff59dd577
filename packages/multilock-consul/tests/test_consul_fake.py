"""`ConsulProvider`'s own logic, on an in-memory fake of py-consul's client.

The fake models only what the provider uses (sessions with TTL, KV ``acquire``/``release``
/``cas``, index-based blocking reads) as documented by Consul; it is not Consul, and
these tests are no substitute for ``integration/test_consul.py`` against a real server.
They cover what a real server cannot easily show: a lost reply, a cancelled acquire
mid-call, a session invalidated behind the holder's back, a value multilock did not write.
Sessions never expire here by time, so the contract checks that wait for a lease do not
run here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
from typing import Any

import consul
import pytest
import requests

from multilock.consul import ConsulProvider
from multilock.core import ConfigurationError, ProviderError
from multilock.core.testing import PROVIDER_CHECKS, check_provider

LEASE = 10.0


class FakeConsul:
    """Sessions and KV locks in memory, behind py-consul's method names."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.index = itertools.count(100)
        self.last = 99
        self.keys: dict[str, dict[str, Any]] = {}
        self.changed: dict[str, int] = {}
        self.sessions: dict[str, dict[str, Any]] = {}
        self.kv = self
        self.session = _Sessions(self)
        self.http = type("Http", (), {"host": "fake", "port": 8500, "scheme": "http"})()
        self.token: str | None = None
        self.put_hook: Any = None
        #: Blocking queries started, per key, and an event set as each one starts.
        self.blocking: dict[str, int] = {}
        self.query_started = threading.Event()

    def _write(self, key: str) -> int:
        self.last = next(self.index)
        self.changed[key] = self.last
        self.cond.notify_all()
        return self.last

    def get(
        self, key: str, index: int | None = None, wait: str | None = None, **_: Any
    ) -> tuple[str, dict[str, Any] | None]:
        with self.cond:
            if index:
                self.blocking[key] = self.blocking.get(key, 0) + 1
                self.query_started.set()
                seconds = float(wait.removesuffix("s")) if wait else 300.0
                self.cond.wait_for(lambda: self.changed.get(key, index) != index, seconds)
            entry = self.keys.get(key)
            return str(self.changed.get(key, self.last)), dict(entry) if entry else None

    def put(
        self,
        key: str,
        value: bytes,
        cas: int | None = None,
        acquire: str | None = None,
        release: str | None = None,
        **_: Any,
    ) -> bool:
        assert isinstance(value, bytes)
        if self.put_hook is not None:
            self.put_hook("before", key, acquire)
        with self.cond:
            entry = self.keys.get(key)
            if cas is not None and (entry["ModifyIndex"] if entry else 0) != cas:
                return False
            holder = entry.get("Session") if entry else None
            if acquire is not None:
                if acquire not in self.sessions or holder not in (None, acquire):
                    return False
                holder = acquire
            if release is not None:
                if holder != release:
                    return False
                holder = None
            index = self._write(key)
            self.keys[key] = {
                "Key": key,
                "Value": value,
                "ModifyIndex": index,
                "CreateIndex": entry["CreateIndex"] if entry else index,
                "Session": holder,
            }
        if self.put_hook is not None:
            self.put_hook("after", key, acquire)
        return True

    def invalidate(self, session: str) -> None:
        """What Consul does when a TTL is missed: behavior delete drops the held keys."""
        with self.cond:
            del self.sessions[session]
            for key, entry in list(self.keys.items()):
                if entry.get("Session") == session:
                    del self.keys[key]
                    self._write(key)


class _Sessions:
    def __init__(self, fake: FakeConsul) -> None:
        self.fake = fake
        self.ids = itertools.count(1)

    def create(self, **options: Any) -> str:
        assert options["lock_delay"] == 0
        assert options["checks"] == []
        assert options["behavior"] == "delete"
        assert 10 <= options["ttl"] <= 86400
        assert isinstance(options["ttl"], int)
        with self.fake.cond:
            session = f"session-{next(self.ids)}"
            self.fake.sessions[session] = options
            return session

    def renew(self, session: str) -> dict[str, Any]:
        with self.fake.cond:
            if session not in self.fake.sessions:
                raise consul.NotFound(f"Session id '{session}' not found")
            return {"ID": session}

    def destroy(self, session: str) -> bool:
        with self.fake.cond:
            if session in self.fake.sessions:
                self.fake.invalidate(session)
            return True


@pytest.fixture
def fake() -> FakeConsul:
    return FakeConsul()


def provider_on(fake: FakeConsul) -> ConsulProvider:
    return ConsulProvider(fake, timeout=1.0, watch_wait=2.0)


# The checks that wait for a lease to run out, or renew over several: the fake never
# expires a session and Consul's leases are at least 10 s. Every other check of the
# contract, a new one too, runs on the fake.
NEEDS_LEASES_TO_PASS = {"renew_extends", "expiry_frees_the_group", "tokens_strictly_increase"}
FAKE_CHECKS = [name for name in PROVIDER_CHECKS if name not in NEEDS_LEASES_TO_PASS]


def test_the_checks_left_out_exist() -> None:
    """A renamed check must not drop out of the list above unnoticed."""
    assert set(PROVIDER_CHECKS) >= NEEDS_LEASES_TO_PASS


@pytest.mark.parametrize("check", FAKE_CHECKS)
async def test_contract_checks_on_the_fake(fake: FakeConsul, check: str) -> None:
    await check_provider(lambda: provider_on(fake), lease_duration=LEASE, only=check)


async def test_record_token_and_session(fake: FakeConsul) -> None:
    p = provider_on(fake)
    info = await p.try_acquire("g", "p1", 12.5, {"k": "v"})
    assert info is not None
    entry = fake.keys["multilock/g"]
    assert info.token == entry["ModifyIndex"]
    record = json.loads(entry["Value"])
    assert record["participant"] == "p1"
    assert record["metadata"] == {"k": "v"}
    assert fake.sessions[entry["Session"]]["ttl"] == 13
    # New metadata is a new write: ModifyIndex moves, the token does not.
    assert await p.renew("g", "p1", info.token, 12.5, {"k": "w"})
    assert fake.keys["multilock/g"]["ModifyIndex"] > info.token
    leader = await p.get_leader("g")
    assert leader is not None
    assert leader.token == info.token
    assert leader.metadata == {"k": "w"}
    await p.release("g", "p1", info.token)
    assert fake.sessions == {}, "release did not destroy the session"
    assert fake.keys["multilock/g"]["Session"] is None
    nxt = await p.try_acquire("g", "p2", LEASE, {})
    assert nxt is not None
    assert nxt.token > fake.keys["multilock/g"]["ModifyIndex"] - 1 > info.token


async def test_a_lost_reply_to_acquire_is_taken_up_with_renew(fake: FakeConsul) -> None:
    """The provider keeps the session of an acquire whose reply was lost: the election
    finds the term with get_leader and takes it up with renew; acquires write nothing."""
    p = provider_on(fake)

    def lose_reply(when: str, key: str, acquire: str | None) -> None:
        if when == "after" and acquire is not None:
            fake.put_hook = None
            raise requests.ConnectionError("connection reset by peer")

    fake.put_hook = lose_reply
    with pytest.raises(ProviderError) as raised:
        await p.try_acquire("g", "p1", LEASE, {"instance": "a"})
    assert isinstance(raised.value.__cause__, requests.ConnectionError)
    held = await p.get_leader("g")
    assert held is not None
    assert (held.participant_id, held.metadata) == ("p1", {"instance": "a"})
    written = fake.keys["multilock/g"]["ModifyIndex"]
    assert await p.try_acquire("g", "p1", LEASE, {"instance": "a"}) is None
    assert await provider_on(fake).try_acquire("g", "p1", LEASE, {"instance": "b"}) is None
    assert fake.keys["multilock/g"]["ModifyIndex"] == written, "a refused acquire wrote"
    assert len(fake.sessions) == 1, "a refused acquire made a session"
    assert await p.renew("g", "p1", held.token, LEASE, {"instance": "a"})
    assert await p.get_leader("g") == held
    await p.release("g", "p1", held.token)
    assert fake.sessions == {}
    assert await p.get_leader("g") is None


async def test_the_same_participant_id_elsewhere_gets_none_and_writes_nothing(
    fake: FakeConsul,
) -> None:
    """Two processes configured with one participant id: the second cannot join, renew or
    release the first one's term."""
    p, q = provider_on(fake), provider_on(fake)
    info = await p.try_acquire("g", "p1", LEASE, {"instance": "a"})
    assert info is not None
    before = dict(fake.keys["multilock/g"])
    sessions = dict(fake.sessions)
    assert await q.try_acquire("g", "p1", LEASE, {"instance": "b"}) is None
    assert not await q.renew("g", "p1", info.token, LEASE, {"instance": "b"})
    await q.release("g", "p1", info.token)
    assert fake.keys["multilock/g"] == before
    assert fake.sessions == sessions
    assert await q.get_leader("g") == info
    await p.release("g", "p1", info.token)


async def test_an_acquire_that_never_ran_leaves_no_session_behind(fake: FakeConsul) -> None:
    p = provider_on(fake)

    def fail(when: str, key: str, acquire: str | None) -> None:
        fake.put_hook = None
        raise requests.ConnectionError("connection refused")

    fake.put_hook = fail
    with pytest.raises(ProviderError):
        await p.try_acquire("g", "p1", LEASE, {})
    assert len(fake.sessions) == 1  # kept, in case the PUT had gone through
    assert await p.get_leader("g") is None
    info = await p.try_acquire("g", "p1", LEASE, {})
    assert info is not None
    assert list(fake.sessions) == [fake.keys["multilock/g"]["Session"]], "the idle one lives"
    await p.release("g", "p1", info.token)


async def test_a_cancelled_acquire_gives_back_the_term_it_took(fake: FakeConsul) -> None:
    p = provider_on(fake)
    entered, gate = threading.Event(), threading.Event()

    def hold(when: str, key: str, acquire: str | None) -> None:
        if when == "after":
            entered.set()
            gate.wait(5)

    fake.put_hook = hold
    task = asyncio.ensure_future(p.try_acquire("g", "p1", LEASE, {}))
    assert await asyncio.to_thread(entered.wait, 5)
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done(), "the cancel did not wait for the worker"
    fake.put_hook = None
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await p.get_leader("g") is None
    assert fake.sessions == {}


async def test_an_invalidated_session_ends_the_term(fake: FakeConsul) -> None:
    p = provider_on(fake)
    info = await p.try_acquire("g", "p1", LEASE, {})
    assert info is not None
    watch = p.watch("g")
    await anext(watch)
    fake.invalidate(fake.keys["multilock/g"]["Session"])
    async with asyncio.timeout(5):
        await anext(watch)
    await watch.aclose()
    assert await p.get_leader("g") is None
    assert not await p.renew("g", "p1", info.token, LEASE, {})
    taken = await provider_on(fake).try_acquire("g", "p2", LEASE, {})
    assert taken is not None
    assert taken.token > info.token


async def test_watch_wakes_on_release_and_acquire(fake: FakeConsul) -> None:
    p, q = provider_on(fake), provider_on(fake)
    watch = q.watch("g")
    await anext(watch)
    info = await p.try_acquire("g", "p1", LEASE, {})
    assert info is not None
    async with asyncio.timeout(5):
        await anext(watch)
    await p.release("g", "p1", info.token)
    async with asyncio.timeout(5):
        await anext(watch)
    await watch.aclose()


async def test_watches_of_one_group_share_one_blocking_query_loop(fake: FakeConsul) -> None:
    """Three watches of one group on one provider: one loop of blocking queries, whose
    wake-up reaches all three."""
    p = provider_on(fake)
    watches = [p.watch("g") for _ in range(3)]
    async with asyncio.timeout(5):
        for watch in watches:
            await anext(watch)  # subscribed
    woken = [asyncio.ensure_future(anext(watch)) for watch in watches]
    assert await asyncio.to_thread(fake.query_started.wait, 5)
    info = await provider_on(fake).try_acquire("g", "p1", LEASE, {})
    assert info is not None
    async with asyncio.timeout(5):
        await asyncio.gather(*woken)
    # The query the acquire ended, and perhaps the next one: never one per watch.
    assert fake.blocking["multilock/g"] <= 2, fake.blocking
    for watch in watches:
        await watch.aclose()  # type: ignore[attr-defined]
    assert p._feeds.groups == frozenset(), "the group's loop outlived its last watch"
    await p.aclose()


async def test_a_longer_lease_mid_term_is_refused_not_dropped(fake: FakeConsul) -> None:
    p = provider_on(fake)
    info = await p.try_acquire("g", "p1", LEASE, {})
    assert info is not None
    with pytest.raises(ConfigurationError, match="cannot lengthen"):
        await p.renew("g", "p1", info.token, LEASE * 2, {})
    assert await p.try_acquire("g", "p1", LEASE * 2, {}) is None
    assert await p.renew("g", "p1", info.token, LEASE, {}), "the term was dropped"


async def test_foreign_values_raise_provider_error(fake: FakeConsul) -> None:
    fake.keys["multilock/g"] = {"Key": "multilock/g", "Value": b"not json", "ModifyIndex": 5}
    fake.keys["multilock/g"]["Session"] = "someone"
    with pytest.raises(ProviderError, match="did not write"):
        await provider_on(fake).get_leader("g")


async def test_driver_errors_are_wrapped_and_scrubbed(fake: FakeConsul) -> None:
    secret = "acl-0a1b2c"

    def deny(when: str, key: str, acquire: str | None) -> None:
        raise consul.ACLPermissionDenied(f"token {secret} lacks key:write on {key}")

    fake.put_hook = deny
    p = ConsulProvider(fake, token=secret)
    with pytest.raises(ProviderError) as raised:
        await p.try_acquire("g", "p1", LEASE, {})
    assert secret not in str(raised.value)
    assert "lacks key:write" in str(raised.value)
    # The driver's error holds the token: it is not chained, so no secret travels with it.
    assert raised.value.__cause__ is None

    def deny_plainly(when: str, key: str, acquire: str | None) -> None:
        raise consul.ACLPermissionDenied(f"no key:write on {key}")

    fake.put_hook = deny_plainly
    with pytest.raises(ProviderError) as raised:
        await p.try_acquire("g", "p1", LEASE, {})
    assert isinstance(raised.value.__cause__, consul.ACLPermissionDenied)
    with contextlib.suppress(ProviderError):
        await p.aclose()
