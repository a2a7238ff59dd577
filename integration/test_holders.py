"""`Lock`, `Semaphore` and `Shards` on every backend, with contenders that do not share a
connection, and a real holder process killed with SIGKILL.

Each contender gets a provider of its own (``backend.make_provider()``: its own
connections, as another process would have), all on one event loop, so the test sees
every holder's view on one clock. What is checked:

- Lock: two holders never overlap (the intervals between entering and leaving the block,
  and a sampler that counts valid terms every few milliseconds), tokens rise in the order
  the holders got in, a waiter gets in promptly once the holder leaves (a notifying store
  wakes it at once; a polling one within its poll), and a waiter with a timeout gets
  `AcquireTimeout` naming the holder;
- Semaphore(limit=2): never more than two valid holders at any instant and never two in
  one slot, two at once do get in, tokens rise per slot, every contender gets through;
- Shards(count=6): three participants settle on two shards each, every shard owned by
  exactly one; when one leaves, the other two take its shards, three each; no shard ever
  has two valid owners, and a shard's token rises when it changes owner;
- a child process holds a Lock and is SIGKILLed: the parent, already waiting, gets in
  once the lease has expired (not before the child's last local deadline) with a higher
  token.

Leases are short (2 s, or the backend's minimum: Azure 15 s, Consul 10 s); nothing here
waits for a lease to expire except the SIGKILL test. Every wait polls a condition until a
deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from harness import Backend
from harness.faults import STARTUP_TIMEOUT, failover_bound, require_multiprocess
from multilock.core import (
    AcquireTimeout,
    Leadership,
    Lock,
    Provider,
    Semaphore,
    ShardLeadership,
    Shards,
)

#: The shortest lease used here; a backend with a longer minimum uses its own.
LEASE = 2.0
#: The followers' retry interval in the Lock test: a notifying store must beat it by far.
RETRY = 2.0
#: Slack for a loaded 2-core machine: a wake-up, a store round trip, the release itself.
SLACK = 0.5
#: How often the samplers and the waits look.
POLL = 0.01
#: A waiter's timeout in the AcquireTimeout check.
TIMEOUT = 1.0
#: How long a bounded step may run before the test gives up (a failure, not a skip).
GIVE_UP = 60.0
HOLDER = Path(__file__).parent / "harness" / "holder_process.py"

#: Measured times, by backend, then by what: printed when the module finishes.
TIMES: dict[str, dict[str, float]] = {}


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not TIMES:
        return
    lines = ["", "multilock holders: measured times (s)"]
    for backend, measured in sorted(TIMES.items()):
        shown = ", ".join(f"{what} {value:.3f}" for what, value in measured.items())
        lines.append(f"  {backend:<12} {shown}")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        print("\n".join(lines))
        return
    with capture.global_and_fixture_disabled():
        print("\n".join(lines))


def record(backend: Backend, what: str, seconds: float) -> None:
    TIMES.setdefault(backend.name, {})[what] = seconds


def new_name(kind: str) -> str:
    return f"holders-{kind}-{uuid.uuid4().hex[:10]}"


def lease_for(backend: Backend) -> float:
    return max(LEASE, backend.lease)


def polls_only(provider: Provider) -> bool:
    """True when the provider has no watch: its followers look every ``retry_interval``."""
    return type(provider).watch is Provider.watch


def handoff_bound(provider: Provider, retry: float) -> float:
    """How soon after a holder leaves a waiter on *provider* must be in.

    A notifying store wakes the waiter at once (`SLACK`, far under *retry*); a polling
    watch sees the release at its next read (``notify_delay``); a store without a watch
    is looked at every *retry*.
    """
    if polls_only(provider):
        return retry + SLACK
    return provider.notify_delay + SLACK


async def wait_until(
    what: str,
    condition: Callable[[], bool],
    within: float,
    describe: Callable[[], str] = lambda: "",
) -> float:
    """Poll *condition* until it holds; fail after *within* seconds. Returns when it held."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within:g} s. {describe()}")
        await asyncio.sleep(POLL)
    return time.monotonic()


async def wait_steady(
    what: str,
    condition: Callable[[], bool],
    steady: float,
    within: float,
    describe: Callable[[], str] = lambda: "",
) -> float:
    """Wait until *condition* has held without a break for *steady* seconds."""
    deadline = time.monotonic() + within
    since: float | None = None
    while True:
        now = time.monotonic()
        if condition():
            since = now if since is None else since
            if now - since >= steady:
                return since
        else:
            since = None
        if now > deadline:
            raise AssertionError(
                f"{what}: not steady for {steady:g} s within {within:g} s. {describe()}"
            )
        await asyncio.sleep(POLL)


@contextlib.asynccontextmanager
async def providers(backend: Backend, count: int) -> AsyncIterator[list[Provider]]:
    """*count* providers of *backend*, each with its own connections; closed at the end."""
    made: list[Provider] = []
    try:
        for _ in range(count):
            made.append(backend.make_provider())
        yield made
    finally:
        for provider in made:
            with contextlib.suppress(Exception):
                await provider.aclose()


class Sampler:
    """Calls *check* every `POLL` seconds while in use; collects what it reports."""

    def __init__(self, check: Callable[[], str | None]) -> None:
        self.check = check
        self.violations: list[str] = []
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(POLL)

    def sample(self) -> None:
        self.samples += 1
        problem = self.check()
        if problem is not None and len(self.violations) < 20:
            self.violations.append(f"t={time.monotonic():.3f}: {problem}")

    async def __aenter__(self) -> Sampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sample()


@attrs.define
class Term:
    """One holder's stay in a block: [start, end] on the monotonic clock."""

    who: str
    token: int
    start: float
    end: float = float("inf")
    slot: int = 0


def describe_terms(terms: Sequence[Term]) -> str:
    return "; ".join(
        f"{t.who} slot {t.slot} token {t.token} [{t.start:.3f}, {t.end:.3f}]"
        for t in sorted(terms, key=lambda t: t.start)
    )


def most_at_once(terms: Sequence[Term]) -> int:
    """The largest number of terms open at one instant (an end before an equal start)."""
    edges = sorted([(t.start, 1) for t in terms] + [(t.end, -1) for t in terms])
    open_, most = 0, 0
    for _, step in edges:
        open_ += step
        most = max(most, open_)
    return most


def assert_exclusive_and_rising(terms: Sequence[Term], what: str) -> None:
    """In start order, each term starts after the one before ended, with a higher token."""
    ordered = sorted(terms, key=lambda t: t.start)
    for before, after in itertools.pairwise(ordered):
        assert after.start >= before.end, f"{what}: terms overlap: {describe_terms(ordered)}"
        assert after.token > before.token, f"{what}: token did not rise: {describe_terms(ordered)}"


def assert_no_errors(caplog: pytest.LogCaptureFixture) -> None:
    """No ERROR from the library or from asyncio (a background task that failed unseen)."""
    errors = [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name.split(".")[0] in ("multilock", "asyncio")
    ]
    assert errors == [], errors


# -- Lock ---------------------------------------------------------------------------------


async def test_lock_excludes_hands_over_and_times_out(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    lease = lease_for(backend)
    name = new_name("lock")
    a, b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    terms: list[Term] = []
    holding: dict[str, Leadership] = {}

    def lock(provider: Provider, who: str, timeout: float | None = GIVE_UP) -> Lock:
        return Lock(
            provider,
            name,
            lease_duration=lease,
            retry_interval=RETRY,
            timeout=timeout,
            participant_id=who,
        )

    def at_most_one() -> str | None:
        valid = [who for who, held in holding.items() if held.is_valid]
        return f"{len(valid)} valid holders: {valid}" if len(valid) > 1 else None

    async def hold(provider: Provider, who: str, seconds: float) -> Term:
        async with lock(provider, who) as held:
            term = Term(who, held.token, time.monotonic())
            holding[who] = held
            await asyncio.sleep(seconds)
            held.check()
            del holding[who]
            term.end = time.monotonic()
        terms.append(term)
        return term

    async with providers(backend, 2) as (first, second), Sampler(at_most_one) as sampler:
        bound = handoff_bound(second, RETRY)

        # 1. A holds; B, with a timeout, gives up after it, naming A.
        async with lock(first, a) as held_a:
            term_a = Term(a, held_a.token, time.monotonic())
            holding[a] = held_a
            started = time.monotonic()
            with pytest.raises(AcquireTimeout) as caught:
                async with lock(second, b, timeout=TIMEOUT):
                    pytest.fail(f"{b} got the lock while {a} held it")
            took = time.monotonic() - started
            assert TIMEOUT - 0.01 <= took <= TIMEOUT + 2 * SLACK, (
                f"AcquireTimeout after {took:.3f} s for a timeout of {TIMEOUT} s"
            )
            assert a in str(caught.value), f"the timeout does not name the holder: {caught.value}"

            # 2. B waits without a timeout while A holds (a fixed step, not a wait).
            waiter = asyncio.get_running_loop().create_task(hold(second, b, 0.1))
            await asyncio.sleep(0.5)
            assert not waiter.done(), f"{b} finished while {a} held the lock: {waiter}"
            held_a.check()
            del holding[a]
            term_a.end = leaving = time.monotonic()
        terms.append(term_a)

        term_b = await asyncio.wait_for(waiter, GIVE_UP)
        handoff = term_b.start - leaving
        record(backend, "lock handoff", handoff)
        assert handoff <= bound, (
            f"{backend.name}: {b} got in {handoff:.3f} s after {a} left; bound {bound:.3f} s "
            f"(retry_interval {RETRY} s, notify_delay {second.notify_delay} s)"
        )
        assert term_b.token > term_a.token

        # 3. Both contend, three rounds each.
        async def rounds(provider: Provider, who: str) -> None:
            for _ in range(3):
                await hold(provider, who, 0.05)

        await asyncio.wait_for(asyncio.gather(rounds(first, a), rounds(second, b)), GIVE_UP)

    assert sampler.violations == [], sampler.violations
    assert_no_errors(caplog)
    assert len(terms) == 8, describe_terms(terms)
    assert_exclusive_and_rising(terms, f"{backend.name} lock")


# -- Semaphore ----------------------------------------------------------------------------


async def test_semaphore_admits_two_of_four(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    limit, contenders = 2, 4
    lease = lease_for(backend)
    name = new_name("sem")
    terms: list[Term] = []
    holding: dict[str, Leadership] = {}
    slots_held: dict[str, int] = {}

    def within_limit() -> str | None:
        valid = {who: slots_held[who] for who, held in holding.items() if held.is_valid}
        if len(valid) > limit:
            return f"{len(valid)} valid holders: {valid}"
        if len(set(valid.values())) < len(valid):
            return f"two holders in one slot: {valid}"
        return None

    async with providers(backend, contenders) as made, Sampler(within_limit) as sampler:
        # The first two in must overlap: on a polling store the second may be in only at
        # its next poll (its first try lost the slot to a waiter that won both and then
        # let one go), so hold longer there, and run two rounds only where hand-offs are
        # quick.
        bound = handoff_bound(made[0], min(2.0, lease))
        quick = bound <= SLACK
        hold_for = 0.3 if quick else bound + 0.3
        rounds = 2 if quick else 1

        async def contender(index: int, provider: Provider) -> None:
            who = f"c{index}-{uuid.uuid4().hex[:6]}"
            semaphore = Semaphore(
                provider, name, limit, lease_duration=lease, timeout=GIVE_UP, participant_id=who
            )
            for _ in range(rounds):
                async with semaphore as held:
                    term = Term(who, held.token, time.monotonic(), slot=held.slot)
                    holding[who], slots_held[who] = held, held.slot
                    assert held.group == f"{name}.slot-{held.slot}", (held.group, held.slot)
                    await asyncio.sleep(hold_for)
                    held.check()
                    del holding[who]
                    term.end = time.monotonic()
                terms.append(term)

        await asyncio.wait_for(
            asyncio.gather(*(contender(i, p) for i, p in enumerate(made))), GIVE_UP * 2
        )

    assert sampler.violations == [], sampler.violations
    assert_no_errors(caplog)
    assert len(terms) == contenders * rounds, describe_terms(terms)
    assert len({t.who for t in terms}) == contenders
    assert most_at_once(terms) == limit, (
        f"expected exactly {limit} holders at once at some point: {describe_terms(terms)}"
    )
    assert {t.slot for t in terms} == set(range(limit))
    for slot in range(limit):
        in_slot = [t for t in terms if t.slot == slot]
        assert_exclusive_and_rising(in_slot, f"{backend.name} semaphore slot {slot}")


# -- Shards -------------------------------------------------------------------------------


def ownership(participants: Sequence[Shards]) -> list[dict[int, ShardLeadership]]:
    """Each participant's valid shards."""
    return [
        {i: held for i, held in shards.owned.items() if held.is_valid} for shards in participants
    ]


def balanced(participants: Sequence[Shards], count: int, each: int) -> bool:
    owned = [set(o) for o in ownership(participants)]
    union = set().union(*owned)
    return (
        union == set(range(count))
        and sum(len(o) for o in owned) == count
        and all(len(o) == each for o in owned)
        and all(s.live_participants == len(participants) for s in participants)
    )


def show(participants: Sequence[Shards]) -> str:
    return "; ".join(
        f"{s.participant_id}: owned {sorted(o)} share {s.share} live {s.live_participants}"
        for s, o in zip(participants, ownership(participants), strict=True)
    )


async def test_shards_balance_and_take_over(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    count, size = 6, 3
    lease = lease_for(backend)
    retry = 0.5
    name = new_name("shards")
    # Settling takes a few counting rounds; a leaving participant releases (no expiry).
    within = 4 * lease + 10
    steady = 2 * retry  # two counting rounds of every participant: no change
    async with providers(backend, size) as made:
        participants = [
            Shards(
                provider,
                name,
                count,
                lease_duration=lease,
                retry_interval=retry,
                participant_id=f"p{i}-{uuid.uuid4().hex[:6]}",
            )
            for i, provider in enumerate(made)
        ]
        active: list[Shards] = list(participants)

        def one_owner() -> str | None:
            seen: dict[int, str] = {}
            for shards, owned in zip(active, ownership(active), strict=True):
                for index in owned:
                    if index in seen:
                        return f"shard {index} owned by {seen[index]} and {shards.participant_id}"
                    seen[index] = shards.participant_id
            return None

        try:
            async with Sampler(one_owner) as sampler:
                joined = time.monotonic()
                for shards in participants:
                    await shards.__aenter__()
                settled = await wait_steady(
                    "6 shards, 2 each",
                    lambda: balanced(participants, count, 2),
                    steady,
                    within,
                    lambda: show(participants),
                )
                before = {
                    index: (shards.participant_id, held.token)
                    for shards, owned in zip(participants, ownership(participants), strict=True)
                    for index, held in owned.items()
                }
                record(backend, "shards 2/2/2", settled - joined)
                assert all(s.share == 2 for s in participants), show(participants)

                leaving = participants[0]
                left = time.monotonic()
                await asyncio.wait_for(leaving.aclose(), GIVE_UP)
                assert leaving.owned == {}, leaving.owned
                active.remove(leaving)
                rebalanced = await wait_steady(
                    "the other two own all 6, 3 each",
                    lambda: balanced(active, count, 3),
                    steady,
                    within,
                    lambda: show(active),
                )
                record(backend, "shards 3/3", rebalanced - left)
                after = {
                    index: (shards.participant_id, held.token)
                    for shards, owned in zip(active, ownership(active), strict=True)
                    for index, held in owned.items()
                }
        finally:
            for shards in participants:
                await asyncio.wait_for(shards.aclose(), GIVE_UP)

    assert sampler.violations == [], sampler.violations
    assert_no_errors(caplog)
    for index in range(count):
        (old_owner, old_token), (new_owner, new_token) = before[index], after[index]
        if new_owner == old_owner:
            assert new_token >= old_token, (index, before, after)
        else:
            assert new_token > old_token, (index, before, after)
    moved = [i for i in range(count) if before[i][0] == leaving.participant_id]
    assert len(moved) == 2
    assert all(after[i][0] != leaving.participant_id for i in moved)


# -- a real holder process, killed --------------------------------------------------------


@attrs.define
class Child:
    """The holder process's JSON lines, read as they come."""

    process: asyncio.subprocess.Process
    records: list[dict[str, Any]] = attrs.field(factory=list)

    async def read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            self.records.append(json.loads(line))

    def find(self, event: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r["event"] == event), None)


@pytest.mark.slow
async def test_killed_holder_is_succeeded_after_its_lease(backend: Backend, tmp_path: Path) -> None:
    require_multiprocess(backend)
    lease = backend.lease
    name = new_name("kill")
    child_id = f"child-{uuid.uuid4().hex[:6]}"
    stderr = tmp_path / "holder.stderr"
    env = {**os.environ, "MULTILOCK_HOLDER_URL": backend.url}
    with stderr.open("wb") as errors:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HOLDER),
            name,
            str(lease),
            child_id,
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
            env=env,
        )
    child = Child(process)
    reader = asyncio.get_running_loop().create_task(child.read())

    def child_says() -> str:
        return f"child lines: {child.records}; stderr: {stderr.read_text(errors='replace')}"

    waiter: asyncio.Task[tuple[float, int]] | None = None
    async with providers(backend, 1) as (provider,):
        try:
            await wait_until(
                "the child holds the lock",
                lambda: child.find("acquired") is not None or reader.done(),
                STARTUP_TIMEOUT,
                child_says,
            )
            acquired = child.find("acquired")
            assert acquired is not None, child_says()
            # Kill a term that has been renewed, not one still on its first lease.
            await wait_until(
                "the child renews its lease",
                lambda: child.find("deadline") is not None or reader.done(),
                lease + STARTUP_TIMEOUT,
                child_says,
            )
            assert child.find("deadline") is not None, child_says()

            async def take() -> tuple[float, int]:
                lock = Lock(provider, name, lease_duration=lease, timeout=GIVE_UP)
                async with lock as held:
                    return time.monotonic(), held.token

            waiter = asyncio.get_running_loop().create_task(take())
            await asyncio.sleep(0.3)  # the parent follows the child a while (a fixed step)
            assert not waiter.done(), f"the parent got in while the child held: {waiter}"
            process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.wait_for(process.wait(), 10)
            await asyncio.wait_for(reader, 10)
            assert process.returncode == -signal.SIGKILL, child_says()
            assert child.find("lost") is None, child_says()
            last_deadline = max(r["deadline"] for r in child.records if "deadline" in r)

            got_at, token = await asyncio.wait_for(waiter, GIVE_UP)
        finally:
            if waiter is not None and not waiter.done():
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
            if process.returncode is None:
                process.kill()
                await process.wait()
            reader.cancel()

    took = got_at - killed_at
    record(backend, "kill takeover", took)
    record(backend, "after deadline", got_at - last_deadline)
    assert got_at >= last_deadline, (
        f"{backend.name}: the parent got in {last_deadline - got_at:.3f} s before the killed "
        f"child's lease could have ended (lease {lease} s). {child_says()}"
    )
    assert took <= failover_bound(backend), (
        f"{backend.name}: the parent got in {took:.3f} s after the kill; bound "
        f"{failover_bound(backend):.3f} s (lease {lease} s)"
    )
    assert token > acquired["token"], (token, acquired)
