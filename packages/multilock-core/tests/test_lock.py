"""`Lock`: fenced mutual exclusion over a store, driven in virtual time.

Every test runs on a `FakeClock` with an `InMemoryProvider` judging expiry on the same
clock: nothing sleeps for real, and each run is deterministic.
"""

import asyncio
import contextlib
import itertools
import math

import pytest

from multilock.core import (
    AcquireTimeout,
    ConfigurationError,
    InMemoryProvider,
    LeadershipLost,
    Lock,
    MultilockError,
    Provider,
)
from multilock.core._provider import LeaseBounds
from multilock.core.testing import FakeClock, Fault, FaultyProvider

LEASE = 10.0
RENEW = LEASE / 3
RETRY = 2.0
#: Seconds after a release (or a cancel) by which every background stop has finished.
SETTLE = 0.05
#: Two instants closer than this are the same virtual instant (the fake clock moves by
#: one representable step per loop turn).
SAME_INSTANT = 1e-6
#: Virtual seconds after which a test is cut short (it hangs).
VIRTUAL_LIMIT = 3600.0


def run(body):
    clock = FakeClock()

    async def main():
        store = InMemoryProvider(clock=clock.monotonic)
        async with asyncio.timeout(VIRTUAL_LIMIT):  # a hang fails in virtual time, at once
            return await body(clock, store)

    return clock.run(main())


def now():
    return asyncio.get_running_loop().time()


async def until(predicate, within, step=0.01):
    """Wait (virtual time) until *predicate()* is true; fail after *within* seconds."""
    deadline = now() + within
    while not predicate():
        if now() > deadline:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(step)


async def enter(holder, then=None):
    """Enter *holder* and run ``await then(held)`` inside (or leave at once): a whole
    ``async with`` as one statement for ``pytest.raises``."""
    async with holder as held:
        if then is not None:
            await then(held)
    return held


def other_tasks():
    return asyncio.all_tasks() - {asyncio.current_task()}


async def no_tasks_left(before, within=LEASE):
    """Every task started since *before* ends within *within* virtual seconds."""
    await until(lambda: other_tasks() <= before, within)


class Forgetful(InMemoryProvider):
    """An in-memory store that can drop a lease (a failover, an operator's delete) and
    notify its watchers, as a real store's keyspace notification would."""

    def forget(self, group):
        with self._store.lock:
            self._store.leases.pop(group, None)
        self._notify(group)


class Bounded(InMemoryProvider):
    """A store that can only hold leases of 5 to 60 s."""

    @property
    def lease_bounds(self):
        return LeaseBounds(minimum=5.0, maximum=60.0, reason="leases last 5 to 60 s")


# ---------------------------------------------------------------------------- acquire


def test_acquire_holds_the_name_on_the_store_and_exit_releases_it():
    async def body(clock, store):
        lock = Lock(store, "job", lease_duration=LEASE, participant_id="alice")
        assert lock.held_count() == 0
        async with lock as held:
            assert held.group == "job"
            assert held.participant_id == "alice"
            assert held.is_valid
            assert held.token == 1
            leader = await store.get_leader("job")
            assert leader is not None
            assert (leader.participant_id, leader.token) == ("alice", 1)
            assert lock.held_count() == 1
            await asyncio.sleep(3 * LEASE)  # renewed meanwhile
            assert held.is_valid
            assert (await store.get_leader("job")).token == 1
        assert not held.is_valid
        assert lock.held_count() == 0
        assert await store.get_leader("job") is None  # released, not left to expire

    run(body)


def test_a_waiter_gets_the_lock_at_the_instant_of_the_release():
    """The store's notification wakes the waiter: no retry interval is waited."""

    async def body(clock, store):
        entered = {}

        async def holder(who, hold):
            async with Lock(store, "job", lease_duration=LEASE, participant_id=who) as held:
                entered[who] = (now(), held.token)
                await asyncio.sleep(hold)
            return now()

        first = asyncio.create_task(holder("alice", 5.0))
        await until(lambda: "alice" in entered, 1)
        second = asyncio.create_task(holder("bob", 1.0))
        await asyncio.sleep(0.5)
        assert "bob" not in entered  # waits while alice holds
        released = await first
        await second
        acquired, token = entered["bob"]
        assert abs(acquired - released) < SAME_INSTANT, (acquired, released)
        assert token == entered["alice"][1] + 1

    run(body)


def test_tokens_rise_across_successive_holders():
    async def body(clock, store):
        tokens = []
        for i in range(6):
            who = f"p{i % 3}"
            async with Lock(store, "job", lease_duration=LEASE, participant_id=who) as held:
                tokens.append(held.token)
                await asyncio.sleep(1)
        assert tokens == sorted(set(tokens))
        assert len(tokens) == 6
        assert tokens[0] >= 1

    run(body)


def test_timeout_raises_acquire_timeout_naming_the_holder():
    async def body(clock, store):
        before = other_tasks()
        async with Lock(store, "job", lease_duration=LEASE, participant_id="alice") as held:
            started = now()
            bob = Lock(store, "job", lease_duration=LEASE, timeout=3, participant_id="bob")
            with pytest.raises(AcquireTimeout) as caught:
                await enter(bob)
            waited = now() - started
            assert 3 <= waited < 3 + SETTLE, waited
            error = caught.value
            assert isinstance(error, TimeoutError)
            assert isinstance(error, MultilockError)
            message = str(error)
            for part in ("alice", "'job'", "within 3 s", f"token {held.token}"):
                assert part in message, message
            # The timed-out waiter left nothing behind: alice still holds, and once she
            # releases, nobody takes the lock.
            assert (await store.get_leader("job")).participant_id == "alice"
        await asyncio.sleep(SETTLE)
        assert await store.get_leader("job") is None
        await no_tasks_left(before)

    run(body)


def test_timeout_is_met_when_the_lock_frees_in_time():
    async def body(clock, store):
        released = []

        async def hold():
            async with Lock(store, "job", lease_duration=LEASE, participant_id="alice"):
                await asyncio.sleep(2)
            released.append(now())

        task = asyncio.create_task(hold())
        await asyncio.sleep(0.1)
        async with Lock(store, "job", lease_duration=LEASE, timeout=3, participant_id="b") as held:
            assert abs(now() - released[0]) < SAME_INSTANT
            assert held.token == 2
        await task

    run(body)


def test_timeout_on_a_failing_store_says_the_store_failed():
    async def body(clock, store):
        faulty = FaultyProvider(store)
        faulty.inject(Fault.RAISE)
        started = now()
        with pytest.raises(AcquireTimeout, match="the store failed: injected failure"):
            await enter(Lock(faulty, "job", lease_duration=LEASE, timeout=1))
        assert 1 <= now() - started < 1 + SETTLE

    run(body)


def test_timeout_is_honoured_when_the_store_hangs():
    async def body(clock, store):
        faulty = FaultyProvider(store)
        faulty.inject(Fault.HANG)
        started = now()
        with pytest.raises(AcquireTimeout):
            await enter(Lock(faulty, "job", lease_duration=LEASE, timeout=1))
        waited = now() - started
        assert 1 <= waited < 1 + SETTLE, f"timeout=1 raised after {waited:.3f} s"

    run(body)


# ---------------------------------------------------------------------------- loss


async def sleep_recording_cancel(seen, also=None):
    """Sleep "for ever"; record when the lock cancels the sleep (and what *also* says)."""
    try:
        await asyncio.sleep(10 * LEASE)
    except asyncio.CancelledError:
        seen["cancelled"] = now()
        if also is not None:
            seen["also"] = await also()
        raise
    raise AssertionError("the body ran on after the lease was lost")


def test_lease_refused_cancels_the_body_within_the_deadline_and_raises_leadership_lost():
    async def body(clock, store):
        faulty = FaultyProvider(store)
        seen = {}

        async def then(held):
            seen["held"] = held
            await asyncio.sleep(1.0)
            faulty.inject(Fault.REFUSE, "renew")  # the store says: not yours
            seen["injected"], seen["deadline"] = now(), held.deadline
            await sleep_recording_cancel(seen)

        with pytest.raises(LeadershipLost) as caught:
            await enter(Lock(faulty, "job", lease_duration=LEASE, participant_id="a"), then)
        held = seen["held"]
        assert seen["cancelled"] <= seen["injected"] + RENEW + SAME_INSTANT
        assert seen["cancelled"] < seen["deadline"]
        error = caught.value
        assert (error.group, error.token) == ("job", held.token)
        assert "no longer ours" in str(error)
        assert isinstance(error.__cause__, asyncio.CancelledError)
        assert not held.is_valid

    run(body)


def test_lease_dropped_by_the_store_cancels_the_body_at_the_notification():
    async def body(clock, store):
        store = Forgetful(clock=clock.monotonic)
        seen = {}

        async def then(held):
            seen["held"] = held
            await asyncio.sleep(1.0)
            asyncio.get_running_loop().call_soon(store.forget, "job")
            seen["dropped"] = now()
            await sleep_recording_cancel(seen)

        with pytest.raises(LeadershipLost):
            await enter(Lock(store, "job", lease_duration=LEASE), then)
        # The watch's notification makes the holder renew at once, which fails.
        assert seen["cancelled"] - seen["dropped"] < SAME_INSTANT
        assert not seen["held"].is_valid

    run(body)


def test_unreachable_store_cancels_the_body_at_the_deadline_before_the_lease_expires():
    """The body stops at the local deadline, while the store still shows the lease: no
    other holder can have started yet."""

    async def body(clock, store):
        faulty = FaultyProvider(store)
        seen = {}

        async def then(held):
            seen["held"] = held
            await asyncio.sleep(1.0)
            faulty.inject(Fault.HANG)  # partitioned: every call hangs
            seen["deadline"] = held.deadline
            await sleep_recording_cancel(seen, also=lambda: store.get_leader("job"))

        with pytest.raises(LeadershipLost) as caught:
            await enter(Lock(faulty, "job", lease_duration=LEASE, participant_id="a"), then)
        assert abs(seen["cancelled"] - seen["deadline"]) < SAME_INSTANT
        on_store = seen["also"]
        assert on_store is not None
        assert on_store.token == seen["held"].token
        assert "deadline" in str(caught.value)

    run(body)


def test_another_holder_starts_only_after_the_lost_holder_was_cancelled():
    async def body(clock, store):
        faulty = FaultyProvider(store)
        events = []

        async def partitioned():
            with contextlib.suppress(LeadershipLost):
                async with Lock(faulty, "job", lease_duration=LEASE, participant_id="a"):
                    events.append(("a in", now()))
                    faulty.inject(Fault.HANG)
                    try:
                        await asyncio.sleep(10 * LEASE)
                    finally:
                        events.append(("a out", now()))

        async def waiter():
            async with Lock(store, "job", lease_duration=LEASE, participant_id="b") as held:
                events.append(("b in", now()))
                return held.token

        first = asyncio.create_task(partitioned())
        await until(lambda: events, 1)
        token = await waiter()
        await first
        assert [e for e, _ in events] == ["a in", "a out", "b in"]
        times = dict(events)
        assert times["b in"] - times["a in"] <= LEASE + RETRY + SETTLE
        assert token == 2
        faulty.heal()

    run(body)


def test_body_that_swallows_the_cancel_still_raises_leadership_lost():
    async def body(clock, store):
        faulty = FaultyProvider(store)
        swallowed = []

        async def then(held):
            faulty.inject(Fault.REFUSE, "renew")
            try:
                await asyncio.sleep(10 * LEASE)
            except asyncio.CancelledError:
                swallowed.append(now())
            # and returns normally

        with pytest.raises(LeadershipLost):
            await enter(Lock(faulty, "job", lease_duration=LEASE), then)
        assert swallowed
        assert asyncio.current_task().cancelling() == 0  # the lock's cancel was taken back

    run(body)


def test_lease_lost_without_the_body_awaiting_raises_leadership_lost_on_exit():
    """The body ends normally after the deadline passed (a stalled loop): the guard never
    ran, yet the block still reports the loss."""

    async def body(clock, store):
        async def then(held):
            clock.advance(2 * LEASE)  # the loop stalls past the deadline
            assert not held.is_valid

        with pytest.raises(LeadershipLost):
            await enter(Lock(store, "job", lease_duration=LEASE), then)

    run(body)


def test_body_error_propagates_and_the_lock_is_released():
    async def body(clock, store):
        async def then(held):
            await asyncio.sleep(1)
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            await enter(Lock(store, "job", lease_duration=LEASE), then)
        assert await store.get_leader("job") is None
        async with Lock(store, "job", lease_duration=LEASE, timeout=0.1) as held:
            assert held.token == 2

    run(body)


def test_body_error_after_the_loss_wins_over_leadership_lost():
    async def body(clock, store):
        faulty = FaultyProvider(store)

        async def then(held):
            faulty.inject(Fault.REFUSE, "renew")
            try:
                await asyncio.sleep(10 * LEASE)
            except asyncio.CancelledError:
                raise ValueError("cleanup failed") from None

        with pytest.raises(ValueError, match="cleanup failed"):
            await enter(Lock(faulty, "job", lease_duration=LEASE), then)
        assert asyncio.current_task().cancelling() == 0

    run(body)


# ---------------------------------------------------------------------------- cancellation


async def _cancel_waiter_after(store, name, steps=None, at=None):
    """A waiter for *name* is cancelled after *steps* loop turns or *at* virtual seconds.

    Returns whether it had entered the block by then.
    """
    entered = []

    async def wait():
        async with Lock(store, name, lease_duration=LEASE, participant_id="waiter"):
            entered.append(now())
            await asyncio.sleep(10 * LEASE)

    task = asyncio.create_task(wait())
    if steps is not None:
        for _ in range(steps):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(at)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return bool(entered)


def test_cancelling_a_waiter_on_a_free_lock_at_every_step_leaves_nothing_held():
    async def body(clock, store):
        before = other_tasks()
        outcomes = set()
        for steps in range(40):
            name = f"free-{steps}"
            outcomes.add(await _cancel_waiter_after(store, name, steps=steps))
            await asyncio.sleep(SETTLE)
            leader = await store.get_leader(name)
            assert leader is None, f"cancelled after {steps} steps, the store shows {leader}"
            await no_tasks_left(before)
        assert outcomes == {False, True}  # cancelled both while waiting and while holding

    run(body)


def test_cancelling_a_waiter_on_a_held_lock_at_any_time_leaves_nothing_behind():
    async def body(clock, store):
        before = other_tasks()
        points = [("steps", k) for k in range(25)]
        points += [("at", t) for t in (0.001, 0.5, RETRY * 0.75, RETRY, RETRY + 0.01, 5.0, LEASE)]
        for i, (kind, value) in enumerate(points):
            name = f"held-{i}"
            async with Lock(store, name, lease_duration=LEASE, participant_id="holder"):
                kwargs = {"steps": value} if kind == "steps" else {"at": value}
                assert not await _cancel_waiter_after(store, name, **kwargs)
            # Had the cancelled waiter's election lived on, it would take the freed lock.
            await asyncio.sleep(RETRY + SETTLE)
            assert await store.get_leader(name) is None, (kind, value)
            await no_tasks_left(before)

    run(body)


def test_cancelling_the_task_inside_the_block_releases():
    async def body(clock, store):
        before = other_tasks()
        lock = Lock(store, "job", lease_duration=LEASE)
        inside = asyncio.Event()

        async def hold():
            async with lock:
                inside.set()
                await asyncio.sleep(10 * LEASE)

        task = asyncio.create_task(hold())
        await inside.wait()
        await asyncio.sleep(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lock.held_count() == 0
        await asyncio.sleep(SETTLE)
        assert await store.get_leader("job") is None
        await no_tasks_left(before)

    run(body)


class SlowRelease(InMemoryProvider):
    """A store whose release takes a second to answer."""

    async def release(self, group, participant_id, token):
        await asyncio.sleep(1.0)
        await super().release(group, participant_id, token)


def test_cancelling_the_task_during_the_release_does_not_cut_the_release_short():
    async def body(clock, store):
        store = SlowRelease(clock=clock.monotonic)
        before = other_tasks()
        inside = asyncio.Event()

        async def hold():
            async with Lock(store, "job", lease_duration=LEASE):
                inside.set()
            # (leaves at once; the release takes a second)

        task = asyncio.create_task(hold())
        await inside.wait()
        await asyncio.sleep(0.5)
        assert not task.done()  # in the release
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await store.get_leader("job") is not None  # the release still runs on
        await asyncio.sleep(0.5 + SETTLE)
        assert await store.get_leader("job") is None  # released, long before it expires
        await no_tasks_left(before, within=SETTLE)

    run(body)


def test_external_cancel_when_the_lease_is_lost_too_propagates_cancelled_error():
    """The guard's cancel and an outside cancel both hit the body: the outside one wins."""

    async def body(clock, store):
        faulty = FaultyProvider(store)
        holding = {}

        async def hold():
            async with Lock(faulty, "job", lease_duration=LEASE) as held:
                holding["held"] = held
                await asyncio.sleep(10 * LEASE)

        task = asyncio.create_task(hold())
        await until(lambda: holding, 1)
        faulty.inject(Fault.REFUSE, "renew")
        cancelled = []

        async def cancel_when_lost():  # from outside, the moment the term ends
            await holding["held"].wait_lost()
            cancelled.append(task.cancel())

        canceller = asyncio.create_task(cancel_when_lost())
        with pytest.raises(asyncio.CancelledError):
            await task
        await canceller
        assert cancelled == [True]

    run(body)


def test_external_cancel_during_a_stall_past_the_deadline_propagates_cancelled_error():
    """An outside cancel lands, and the loop stalls past the deadline before the task runs
    again: the guard never fired, but the block must not swallow the outside cancel."""

    async def body(clock, store):
        inside = asyncio.Event()

        async def hold():
            async with Lock(store, "job", lease_duration=LEASE):
                inside.set()
                await asyncio.sleep(10 * LEASE)

        task = asyncio.create_task(hold())
        await inside.wait()
        task.cancel()
        clock.advance(2 * LEASE)  # a stall: the deadline passes before anything runs
        with pytest.raises(asyncio.CancelledError):
            await task

    run(body)


# ---------------------------------------------------------------------------- one object, 3 tasks


def test_one_lock_entered_by_three_tasks_excludes_them_and_all_get_through():
    async def body(clock, store):
        lock = Lock(store, "job", lease_duration=LEASE, participant_id="same-id")
        intervals = []
        inside = []
        peak = []

        async def worker(n):
            for _ in range(3):
                async with lock as held:
                    inside.append(n)
                    peak.append(len(inside))
                    start = now()
                    await asyncio.sleep(1.0)
                    assert held.is_valid
                    inside.remove(n)
                    intervals.append((start, now(), held.token, n))

        async with asyncio.timeout(20 * LEASE):
            await asyncio.gather(*(worker(n) for n in range(3)))
        assert max(peak) == 1
        assert len(intervals) == 9
        intervals.sort()
        for (_, end, token, _), (start, _, next_token, _) in itertools.pairwise(intervals):
            assert start >= end, intervals
            assert next_token > token, intervals
        assert {n for *_, n in intervals} == {0, 1, 2}
        assert lock.held_count() == 0
        assert await store.get_leader("job") is None

    run(body)


def test_exit_by_a_task_that_does_not_hold_raises():
    async def body(clock, store):
        lock = Lock(store, "job", lease_duration=LEASE)
        with pytest.raises(MultilockError, match="not held by this task"):
            await lock.__aexit__(None, None, None)

    run(body)


def test_lock_is_not_reentrant_a_nested_enter_times_out():
    async def body(clock, store):
        lock = Lock(store, "job", lease_duration=LEASE, timeout=1)
        async with lock as outer:
            with pytest.raises(AcquireTimeout):
                async with lock:
                    pass
            assert outer.is_valid
            assert lock.held_count() == 1
        assert lock.held_count() == 0
        await asyncio.sleep(SETTLE)
        assert await store.get_leader("job") is None

    run(body)


# ---------------------------------------------------------------------------- configuration


def test_refuses_a_provider_that_is_not_one():
    with pytest.raises(ConfigurationError, match="provider must be a multilock Provider, not str"):
        Lock("memory://", "job")


@pytest.mark.parametrize("name", ["", "has space", "a/b", "x" * 300, 5])
def test_refuses_a_bad_name(name):
    with pytest.raises(ConfigurationError, match="group"):
        Lock(InMemoryProvider(), name)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"group": "other"}, "lock takes no 'group' option: the name gives the group"),
        ({"release_on_stop": False}, "lock takes no 'release_on_stop' option"),
        ({"nonsense": 1}, "nonsense"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"timeout": math.nan}, "timeout"),
        ({"timeout": True}, "timeout must be seconds as a number or a timedelta, not bool"),
        ({"timeout": "5"}, "not str"),
        ({"lease_duration": True}, "lease_duration must be seconds .* not bool"),
        ({"lease_duration": 0.05}, "lease_duration"),
        ({"lease_duration": 1.0, "renew_interval": 0.6}, "renew_interval"),
        ({"lease_duration": 1.0, "retry_interval": 5}, "retry_interval"),
        ({"participant_id": "bad id"}, "participant"),
    ],
)
def test_refuses_bad_options_with_a_clear_message(options, message):
    with pytest.raises(ConfigurationError, match=message):
        Lock(InMemoryProvider(), "job", **options)


def test_refuses_a_lease_the_store_cannot_hold():
    with pytest.raises(ConfigurationError, match=r"Bounded.*5 to 60 s.*leases last 5 to 60 s"):
        Lock(Bounded(), "job", lease_duration=1.0)
    Lock(Bounded(), "job", lease_duration=10.0)


def test_defaults_come_from_the_election():
    lock = Lock(InMemoryProvider(), "job")
    assert lock.name == "job"
    assert lock.timeout is None
    assert lock.options.lease_duration == 15.0
    assert lock.options.renew_interval == 5.0
    assert lock.options.retry_interval == 2.0
    assert lock.options.release_on_stop is True
    assert Lock(InMemoryProvider(), "job", timeout=2.5).timeout == 2.5


def test_repr_is_informative():
    async def body(clock, store):
        lock = Lock(store, "job", lease_duration=LEASE)
        text = repr(lock)
        assert "Lock" in text
        assert "'job'" in text
        assert "held=0" in text
        assert "InMemoryProvider" in text
        async with lock:
            assert "held=1" in repr(lock)

    run(body)


def test_provider_type_is_checked_not_duck_typed():
    class NotAProvider:
        async def try_acquire(self, *args):
            return None

    with pytest.raises(ConfigurationError):
        Lock(NotAProvider(), "job")
    assert isinstance(InMemoryProvider(), Provider)
