"""`Semaphore`: at most *limit* fenced holders of a name, driven in virtual time."""

import asyncio
import contextlib
import random

import pytest

from multilock.core import (
    AcquireTimeout,
    ConfigurationError,
    InMemoryProvider,
    Leadership,
    LeadershipLost,
    MultilockError,
    Semaphore,
    SemaphoreSlot,
)
from multilock.core.testing import FakeClock, Fault, FaultyProvider

LEASE = 10.0
RETRY = 2.0
SETTLE = 0.05
SAME_INSTANT = 1e-6
#: Virtual seconds after which a test is cut short (it hangs).
VIRTUAL_LIMIT = 3600.0


def run(body, seed=None):
    clock = FakeClock()
    state = random.getstate()
    if seed is not None:
        random.seed(seed)  # the library's jitter and slot order too: one seed, one run

    async def main():
        store = InMemoryProvider(clock=clock.monotonic)
        async with asyncio.timeout(VIRTUAL_LIMIT):  # a hang fails in virtual time, at once
            return await body(clock, store)

    try:
        return clock.run(main())
    finally:
        random.setstate(state)


def now():
    return asyncio.get_running_loop().time()


async def until(predicate, within, step=0.01):
    deadline = now() + within
    while not predicate():
        if now() > deadline:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(step)


def other_tasks():
    return asyncio.all_tasks() - {asyncio.current_task()}


async def no_tasks_left(before, within=LEASE):
    await until(lambda: other_tasks() <= before, within)


async def slot_leaders(store, name, limit):
    return [await store.get_leader(f"{name}.slot-{i}") for i in range(limit)]


class Forgetful(InMemoryProvider):
    """An in-memory store that can drop a lease and notify its watchers."""

    def forget(self, group):
        with self._store.lock:
            self._store.leases.pop(group, None)
        self._notify(group)


# ---------------------------------------------------------------------------- the bound


@pytest.mark.parametrize(("seed", "limit", "workers"), [(1, 3, 10), (2, 1, 4), (3, 4, 7)])
def test_never_more_than_limit_holders_over_a_long_random_schedule(seed, limit, workers):
    """Workers come and go at random; at every entry and every 0.05 s sample, at most
    *limit* hold, each on its own slot, each slot's token above all earlier ones, and the
    store shows every holder's own term on its slot."""

    async def body(clock, store):
        schedule = random.Random(seed)
        end = now() + 300.0
        inside: dict[int, tuple[int, int]] = {}  # worker -> (slot, token)
        last_token = [0] * limit
        entries = [0] * workers
        timeouts = []
        problems = []

        async def worker(n):
            sem = Semaphore(store, "pool", limit, lease_duration=LEASE, participant_id=f"w{n}")
            impatient = Semaphore(
                store, "pool", limit, lease_duration=LEASE, timeout=1.0, participant_id=f"w{n}"
            )
            while now() < end:
                await asyncio.sleep(schedule.uniform(0, 3))
                which = impatient if schedule.random() < 0.2 else sem
                try:
                    async with which as held:
                        assert isinstance(held, SemaphoreSlot)
                        if not 0 <= held.slot < limit:
                            problems.append(f"slot {held.slot} out of range")
                        if held.slot in {s for s, _ in inside.values()}:
                            problems.append(f"slot {held.slot} held twice at {now()}")
                        if held.token <= last_token[held.slot]:
                            problems.append(f"token {held.token} did not rise on {held.slot}")
                        last_token[held.slot] = held.token
                        inside[n] = (held.slot, held.token)
                        if len(inside) > limit:
                            problems.append(f"{len(inside)} holders at {now()}")
                        entries[n] += 1
                        try:
                            await asyncio.sleep(schedule.uniform(0.01, 5))
                        finally:
                            del inside[n]
                except AcquireTimeout:
                    timeouts.append(n)

        async def sampler():
            while True:
                await asyncio.sleep(0.05)
                holding = list(inside.items())
                if len({s for _, (s, _) in holding}) != len(holding) or len(holding) > limit:
                    problems.append(f"at {now()}: {holding}")
                leaders = await slot_leaders(store, "pool", limit)
                for n, (slot, token) in holding:
                    leader = leaders[slot]
                    if leader is None or (leader.participant_id, leader.token) != (f"w{n}", token):
                        problems.append(f"at {now()}: w{n} holds {slot}, the store has {leader}")

        before = other_tasks()
        watch = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(n) for n in range(workers)))
        watch.cancel()
        assert problems == []
        assert all(entries), entries  # nobody starved
        assert sum(entries) > 300.0 / 5 * limit / 2, entries  # the slots were kept busy
        await asyncio.sleep(SETTLE)
        assert await slot_leaders(store, "pool", limit) == [None] * limit
        await no_tasks_left(before)

    run(body, seed=seed)


def test_waiters_get_the_slots_as_they_are_freed():
    async def body(clock, store):
        sem = Semaphore(store, "pool", 2, lease_duration=LEASE)
        got = {}
        freed = {}

        async def hold(n, seconds):
            async with sem as held:
                got[n] = (now(), held.slot, held.token)
                await asyncio.sleep(seconds)
                freed[n] = (now(), held.slot)

        first = [asyncio.create_task(hold(0, 3.0)), asyncio.create_task(hold(1, 5.0))]
        await until(lambda: len(got) == 2, 1)
        assert {got[0][1], got[1][1]} == {0, 1}
        waiters = [asyncio.create_task(hold(2, 4.0)), asyncio.create_task(hold(3, 4.0))]
        await asyncio.sleep(0.5)
        assert len(got) == 2  # both wait
        await asyncio.gather(*first, *waiters)
        # Each freed slot went at that instant to a waiter, on the same slot, next token.
        takers = sorted((got[2], got[3]))
        releases = sorted((freed[0], freed[1]))
        for (taken, slot, token), (released, freed_slot) in zip(takers, releases, strict=True):
            assert abs(taken - released) < SAME_INSTANT, (taken, released)
            assert slot == freed_slot
            assert token == 2

    run(body)


def test_acquire_timeout_when_every_slot_is_held_names_the_holders():
    async def body(clock, store):
        before = other_tasks()

        async def hold(who, inside):
            async with Semaphore(store, "pool", 2, lease_duration=LEASE, participant_id=who):
                inside.set()
                await asyncio.sleep(20)

        events = [asyncio.Event(), asyncio.Event()]
        names = ("alice", "bob")
        holders = [asyncio.create_task(hold(w, e)) for w, e in zip(names, events, strict=True)]
        for event in events:
            await event.wait()
        started = now()
        sem = Semaphore(store, "pool", 2, lease_duration=LEASE, timeout=1.5, participant_id="c")
        with pytest.raises(AcquireTimeout) as caught:
            async with sem:
                raise AssertionError("entered a full semaphore")
        assert 1.5 <= now() - started < 1.5 + SETTLE
        assert isinstance(caught.value, TimeoutError)
        message = str(caught.value)
        for part in ("semaphore 'pool'", "alice", "bob"):
            assert part in message, message
        leaders = await slot_leaders(store, "pool", 2)
        assert {leader.participant_id for leader in leaders} == {"alice", "bob"}
        await asyncio.gather(*holders)
        await asyncio.sleep(RETRY + SETTLE)  # the timed-out waiter took nothing afterwards
        assert await slot_leaders(store, "pool", 2) == [None, None]
        await no_tasks_left(before)

    run(body)


def test_timeout_is_honoured_when_the_store_hangs():
    async def body(clock, store):
        faulty = FaultyProvider(store)
        faulty.inject(Fault.HANG)
        started = now()
        with pytest.raises(AcquireTimeout):
            async with Semaphore(faulty, "pool", 3, lease_duration=LEASE, timeout=1):
                raise AssertionError("entered on a hung store")
        waited = now() - started
        assert 1 <= waited < 1 + SETTLE, f"timeout=1 raised after {waited:.3f} s"

    run(body)


def test_losing_one_slot_cancels_only_its_holder():
    async def body(clock, store):
        store = Forgetful(clock=clock.monotonic)
        sem = Semaphore(store, "pool", 3, lease_duration=LEASE)
        slots = {}
        outcome = {}

        async def hold(n):
            try:
                async with sem as held:
                    slots[n] = held.slot
                    await asyncio.sleep(5.0)
                outcome[n] = ("done", now())
            except LeadershipLost as error:
                outcome[n] = ("lost", now(), error.group)

        tasks = [asyncio.create_task(hold(n)) for n in range(3)]
        await until(lambda: len(slots) == 3, 1)
        assert sorted(slots.values()) == [0, 1, 2]
        victim = next(n for n, s in slots.items() if s == 1)
        await asyncio.sleep(1.0)
        dropped = now()
        store.forget("pool.slot-1")
        await asyncio.gather(*tasks)
        assert outcome[victim][:1] == ("lost",)
        assert outcome[victim][1] - dropped < SAME_INSTANT
        assert outcome[victim][2] == "pool.slot-1"
        for n in set(range(3)) - {victim}:
            assert outcome[n][0] == "done", outcome
        # Every slot is free again, the lost one included; tokens go on rising.
        assert await slot_leaders(store, "pool", 3) == [None] * 3
        async with Semaphore(store, "pool", 3, lease_duration=LEASE, timeout=0.1) as again:
            assert again.token == 2

    run(body)


def test_a_holder_that_gets_one_slot_releases_any_other_it_won():
    """All slots free, many waiters at once: each takes exactly one slot, and nothing is
    left held on the store once they leave."""

    async def body(clock, store):
        before = other_tasks()
        sem = Semaphore(store, "pool", 4, lease_duration=LEASE)
        seen = []

        async def hold():
            async with sem as held:
                seen.append(held.slot)
                await asyncio.sleep(1.0)

        await asyncio.gather(*(hold() for _ in range(4)))
        assert sorted(seen) == [0, 1, 2, 3]
        assert now() - 1000.0 < 1.0 + SETTLE  # all four at once: none waited for another
        await asyncio.sleep(SETTLE)
        assert await slot_leaders(store, "pool", 4) == [None] * 4
        await no_tasks_left(before)

    run(body)


def test_cancelling_a_waiter_at_every_step_leaves_no_slot_held():
    async def body(clock, store):
        before = other_tasks()
        for steps in range(40):
            name = f"pool-{steps}"
            holder_in = asyncio.Event()

            async def holder(name=name, holder_in=holder_in):
                async with Semaphore(store, name, 2, lease_duration=LEASE):
                    holder_in.set()
                    await asyncio.sleep(3.0)

            held = asyncio.create_task(holder())
            await holder_in.wait()  # one slot held, one free

            async def waiter(name=name):
                async with Semaphore(store, name, 2, lease_duration=LEASE):
                    await asyncio.sleep(100)

            task = asyncio.create_task(waiter())
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await held
            await asyncio.sleep(RETRY + SETTLE)
            leaders = await slot_leaders(store, name, 2)
            assert leaders == [None, None], (steps, leaders)
            await no_tasks_left(before)

    run(body)


# ---------------------------------------------------------------------------- the API


def test_slot_is_a_leadership_with_its_index():
    async def body(clock, store):
        sem = Semaphore(store, "pool", 3, lease_duration=LEASE, participant_id="me")
        assert sem.limit == 3
        assert sem.name == "pool"
        async with sem as held:
            assert isinstance(held, Leadership)
            assert held.group == f"pool.slot-{held.slot}"
            assert held.participant_id == "me"
            assert held.is_valid
            assert held.token == 1
            assert f"slot={held.slot}" in repr(held)
            assert "token=1" in repr(held)
            assert "held=1" in repr(sem)
            assert "limit=3" in repr(sem)
            assert "'pool'" in repr(sem)
        assert not held.is_valid
        assert "held=0" in repr(sem)

    run(body)


def test_body_error_propagates_and_the_slot_is_released():
    async def body(clock, store):
        sem = Semaphore(store, "pool", 2, lease_duration=LEASE)
        with pytest.raises(ValueError, match="boom"):
            async with sem:
                raise ValueError("boom")
        await asyncio.sleep(SETTLE)
        assert await slot_leaders(store, "pool", 2) == [None, None]

    run(body)


def test_cancelled_holder_releases_its_slot():
    async def body(clock, store):
        sem = Semaphore(store, "pool", 2, lease_duration=LEASE)
        inside = asyncio.Event()

        async def hold():
            async with sem:
                inside.set()
                await asyncio.sleep(100)

        task = asyncio.create_task(hold())
        await inside.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled()
        await asyncio.sleep(SETTLE)
        assert await slot_leaders(store, "pool", 2) == [None, None]

    run(body)


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        (0, "limit must be between 1 and 10000, got 0"),
        (-1, "between 1 and 10000"),
        (10_001, "between 1 and 10000"),
        (True, "limit must be an int, not bool"),
        (2.0, "limit must be an int, not float"),
        ("2", "limit must be an int, not str"),
    ],
)
def test_refuses_a_bad_limit(limit, message):
    with pytest.raises(ConfigurationError, match=message):
        Semaphore(InMemoryProvider(), "pool", limit)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group": "x"}, "semaphore takes no 'group' option"),
        ({"release_on_stop": True}, "semaphore takes no 'release_on_stop' option"),
        ({"timeout": 0}, "timeout"),
        ({"lease_duration": 0.01}, "lease_duration"),
    ],
)
def test_refuses_bad_options(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        Semaphore(InMemoryProvider(), "pool", 2, **kwargs)


def test_refuses_a_name_whose_slot_groups_are_invalid():
    with pytest.raises(ConfigurationError, match="group"):
        Semaphore(InMemoryProvider(), "p" * 250, 2)  # "<name>.slot-0" is over 255
    with pytest.raises(ConfigurationError, match="group"):
        Semaphore(InMemoryProvider(), "bad name", 2)
    with pytest.raises(ConfigurationError, match="provider must be a multilock Provider"):
        Semaphore(object(), "pool", 2)


def test_exit_by_a_task_that_does_not_hold_raises():
    async def body(clock, store):
        with pytest.raises(MultilockError, match="semaphore 'pool' is not held by this task"):
            await Semaphore(store, "pool", 2).__aexit__(None, None, None)

    run(body)
