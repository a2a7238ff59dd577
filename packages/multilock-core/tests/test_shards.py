"""`Shards`: *count* shards shared out among live participants, driven in virtual time.

A `Watch` samples every participant's ``owned`` every 0.05 virtual seconds and checks that
no shard has two owners and that the store holds every term a participant believes in.
"""

import asyncio
import contextlib
import itertools
import math
import random

import pytest

from multilock.core import (
    ConfigurationError,
    InMemoryProvider,
    Leadership,
    MultilockError,
    ShardLeadership,
    Shards,
)
from multilock.core.testing import FakeClock, Fault, FaultyProvider

LEASE = 3.0
RETRY = 2.0
COUNT = 8
SETTLE = 0.05
SAME_INSTANT = 1e-6
VIRTUAL_LIMIT = 3600.0
#: Membership stable this long: every participant owns at most its share.
STABLE = 2 * LEASE + RETRY


def run(body, seed=0):
    clock = FakeClock()
    state = random.getstate()
    random.seed(seed)  # the library's jitter too: one seed, one run

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


def shards(provider, who, count=COUNT, name="w"):
    return Shards(provider, name, count, lease_duration=LEASE, participant_id=who)


def counts(parts):
    return [len(p.owned) for p in parts]


def balanced(parts, count=COUNT):
    """Every shard owned, nobody over ``ceil(count / len(parts))``."""
    owned = [set(p.owned) for p in parts]
    share = math.ceil(count / len(parts))
    return set().union(*owned) == set(range(count)) and max(map(len, owned)) <= share


async def store_owners(store, name="w", count=COUNT):
    return [await store.get_leader(f"{name}.shard-{i}") for i in range(count)]


async def store_members(store, name="w", count=COUNT):
    return [await store.get_leader(f"{name}.member-{i}") for i in range(count)]


class Watch:
    """Check, every 0.05 virtual seconds, that each shard has at most one owner among
    *parts* (a list the test may change) and that the store holds each owner's term."""

    def __init__(self, store, parts, name="w"):
        self.store, self.parts, self.name = store, parts, name
        self.problems = []
        self.samples = 0
        self._task = None

    async def check(self):
        views = [(p, i, v) for p in list(self.parts) for i, v in p.owned.items()]
        owners = {}
        for p, i, view in views:
            if i in owners:
                self.problems.append(f"{now():.3f}: shard {i} owned by {owners[i]} and {p}")
            owners[i] = p.participant_id
            assert isinstance(view, ShardLeadership)
            assert view.shard == i
            leader = await self.store.get_leader(f"{self.name}.shard-{i}")
            mine = (p.participant_id, view.token)
            if leader is None or (leader.participant_id, leader.token) != mine:
                self.problems.append(f"{now():.3f}: {mine} owns {i}, the store has {leader}")
        self.samples += 1

    async def _loop(self):
        while True:
            await self.check()
            await asyncio.sleep(0.05)

    def __enter__(self):
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    def __exit__(self, *exc):
        self._task.cancel()
        assert self.problems == [], self.problems[:5]
        assert self.samples > 0


async def stays(predicate, seconds, what):
    """*predicate* holds at every 0.05 s sample for *seconds*."""
    end = now() + seconds
    while now() < end:
        assert predicate(), f"{what} stopped holding at {now():.3f}"
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------- balance


def test_three_participants_share_eight_shards_without_overlap():
    async def body(clock, store):
        parts = [shards(store, who) for who in "abc"]
        with Watch(store, parts):
            for p in parts:
                await p.__aenter__()
            await asyncio.sleep(STABLE)
            assert balanced(parts), counts(parts)
            assert all(p.live_participants == 3 and p.share == 3 for p in parts)
            await stays(lambda: balanced(parts), 2 * LEASE, "balance")
            # The store agrees, shard by shard.
            owners = await store_owners(store)
            for i, leader in enumerate(owners):
                owner = next(p for p in parts if i in p.owned)
                assert leader.participant_id == owner.participant_id
            for p in parts:
                await p.aclose()
        assert await store_owners(store) == [None] * COUNT
        assert await store_members(store) == [None] * COUNT

    run(body)


def test_a_participant_leaving_hands_its_shards_to_the_others():
    async def body(clock, store):
        parts = [shards(store, who) for who in "abc"]
        with Watch(store, parts):
            for p in parts:
                await p.__aenter__()
            await asyncio.sleep(STABLE)
            assert balanced(parts)
            leaving = parts.pop(1)
            had = set(leaving.owned)
            assert had
            await leaving.aclose()
            assert leaving.owned == {}
            assert leaving.share == 0
            left = now()
            for i in had:  # released at once, not left to expire
                leader = (await store_owners(store))[i]
                assert leader is None or leader.participant_id != "b"
            await until(lambda: counts(parts) == [4, 4] and balanced(parts), 2 * RETRY + LEASE)
            assert now() - left <= 2 * RETRY + SETTLE, now() - left  # counted within a retry
            assert all(p.live_participants == 2 for p in parts)
            await stays(lambda: counts(parts) == [4, 4], 2 * LEASE, "the new balance")
            for p in parts:
                await p.aclose()

    run(body)


def test_a_participant_joining_takes_the_surplus_of_the_others():
    async def body(clock, store):
        parts = [shards(store, who) for who in "ab"]
        with Watch(store, parts):
            for p in parts:
                await p.__aenter__()
            await asyncio.sleep(STABLE)
            assert counts(parts) == [4, 4]
            newcomer = shards(store, "c")
            parts.append(newcomer)
            await newcomer.__aenter__()
            joined = now()
            await until(lambda: balanced(parts), STABLE)
            assert now() - joined <= 2 * RETRY + SETTLE
            assert sorted(counts(parts)) == [2, 3, 3]
            await stays(lambda: balanced(parts), 2 * LEASE, "balance after the join")
            for p in parts:
                await p.aclose()

    run(body)


def test_a_participant_cut_off_from_the_store_loses_its_shards_and_others_take_them():
    async def body(clock, store):
        cut = FaultyProvider(store)
        parts = [shards(store, "a"), shards(store, "b"), shards(cut, "c")]
        with Watch(store, parts):
            for p in parts:
                await p.__aenter__()
            await asyncio.sleep(STABLE)
            assert balanced(parts)
            victim = parts[2]
            assert victim.owned
            cut.inject(Fault.RAISE)  # every call of c's fails from now on
            failed = now()
            # c's terms end at their local deadlines, before the store's leases expire.
            await until(lambda: not victim.owned, LEASE)
            assert now() - failed <= LEASE
            healthy = parts[:2]
            await until(lambda: counts(healthy) == [4, 4], LEASE + 2 * RETRY + SETTLE)
            assert all(p.live_participants == 2 for p in healthy)
            await stays(lambda: counts(healthy) == [4, 4] and not victim.owned, 2 * LEASE, "c out")
            # Back on the store: c rejoins and the three share again.
            cut.heal()
            await until(lambda: balanced(parts), STABLE + RETRY)
            assert sorted(counts(parts)) == [2, 3, 3]
            for p in parts:
                await p.aclose()
        assert await store_owners(store) == [None] * COUNT

    run(body)


def test_more_participants_than_shards_extras_stand_by_and_take_over():
    async def body(clock, store):
        parts = [shards(store, who, count=2) for who in "abcd"]
        with Watch(store, parts):
            for p in parts:
                await p.__aenter__()
            await asyncio.sleep(STABLE)
            assert sorted(counts(parts)) == [0, 0, 1, 1]
            assert balanced(parts, count=2)
            assert sorted(p.share for p in parts) == [0, 0, 1, 1]  # extras are no members
            owner = next(p for p in parts if p.owned)
            parts.remove(owner)
            await owner.aclose()
            await until(lambda: sorted(counts(parts)) == [0, 1, 1], LEASE + 2 * RETRY)
            await stays(lambda: sorted(counts(parts)) == [0, 1, 1], 2 * LEASE, "takeover")
            for p in parts:
                await p.aclose()
        assert await store_owners(store, count=2) == [None, None]
        assert await store_members(store, count=2) == [None, None]

    run(body)


def test_wait_changed_returns_when_ownership_or_membership_changes():
    async def body(clock, store):
        a = shards(store, "a")
        async with a:
            await until(lambda: len(a.owned) == COUNT, STABLE)
            await asyncio.sleep(STABLE)
            waiter = asyncio.create_task(a.wait_changed())
            await asyncio.sleep(2 * LEASE)
            assert not waiter.done()  # nothing changed
            async with shards(store, "b"):
                async with asyncio.timeout(2 * RETRY):
                    await waiter
                await until(lambda: len(a.owned) == 4, STABLE)

    run(body)


# ---------------------------------------------------------------------------- run_for_each


EVEN = {0, 2, 4, 6}


class Recorder:
    """The work of `run_for_each`: records each run's start and end per shard and term."""

    def __init__(self, who, returns_for=()):
        self.who = who
        self.returns_for = set(returns_for)
        self.log = []  # (shard, token, who, start, end, how)

    async def __call__(self, shard):
        assert isinstance(shard, ShardLeadership)
        assert isinstance(shard, Leadership)
        assert shard.is_valid, "work started for an invalid term"
        start = now()
        how = "returned"
        try:
            if shard.shard not in self.returns_for:
                await asyncio.sleep(math.inf)
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        finally:
            self.log.append((shard.shard, shard.token, self.who, start, now(), how))


def check_work(logs):
    """One run per shard and term; per shard, runs never overlap in time."""
    runs = sorted(r for log in logs for r in log)
    terms = [(shard, token) for shard, token, *_ in runs]
    assert len(terms) == len(set(terms)), runs
    by_shard = {}
    for shard, token, who, start, end, how in runs:
        by_shard.setdefault(shard, []).append((start, end, token, who, how))
    for shard, spans in by_shard.items():
        spans.sort()
        for (_, end, token, *_), (start, _, next_token, *_) in itertools.pairwise(spans):
            assert start >= end, f"shard {shard}: overlapping work {spans}"
            assert next_token > token, f"shard {shard}: tokens {spans}"
    return runs


def test_run_for_each_runs_once_per_shard_and_term_and_is_cancelled_on_rebalance():
    async def body(clock, store):
        a, b = shards(store, "a"), shards(store, "b")
        work_a = Recorder("a", returns_for=EVEN)  # some work returns, the rest runs on
        work_b = Recorder("b", returns_for=EVEN)
        parts = [a]
        with Watch(store, parts):
            async with a:
                runner_a = asyncio.create_task(a.run_for_each(work_a))
                await asyncio.sleep(STABLE)
                assert len(a.owned) == COUNT
                # Running: the endless ones; returned once each: the others (not rerun).
                assert sorted(s for s, *_ in work_a.log) == sorted(EVEN)
                parts.append(b)
                async with b:
                    runner_b = asyncio.create_task(b.run_for_each(work_b))
                    await until(lambda: counts(parts) == [4, 4], STABLE)
                    await asyncio.sleep(LEASE)
                    moved = set(b.owned)
                    cancelled = {s for s, _, _, _, _, how in work_a.log if how == "cancelled"}
                    assert moved - EVEN <= cancelled  # released shards' work was stopped
                    started_b = {s for s, *_ in work_b.log} | set(b.owned)
                    assert started_b >= moved
                    parts.remove(b)
                assert runner_b.done()
                assert runner_b.exception() is None
                await until(lambda: len(a.owned) == COUNT, STABLE)
                await asyncio.sleep(SETTLE)
            await asyncio.wait_for(runner_a, SETTLE)
            assert runner_a.exception() is None
        runs = check_work([work_a.log, work_b.log])
        # Every term's work ran exactly once, and ended (returned or cancelled) by the end.
        assert {how for *_, how in runs} == {"returned", "cancelled"}
        assert {s for s, _, who, *_ in runs if who == "b"} == moved

    run(body)


def test_run_for_each_work_stops_before_another_participant_starts_the_shard():
    """A participant cut off from the store: its work is cancelled at its deadline, before
    the shard's lease expires and another participant's work starts."""

    async def body(clock, store):
        cut = FaultyProvider(store)
        a, b = shards(cut, "a"), shards(store, "b")
        work_a, work_b = Recorder("a"), Recorder("b")
        async with a:
            runner_a = asyncio.create_task(a.run_for_each(work_a))
            await until(lambda: len(a.owned) == COUNT, STABLE)
            async with b:
                runner_b = asyncio.create_task(b.run_for_each(work_b))
                await asyncio.sleep(STABLE)
                cut.inject(Fault.HANG)
                await until(lambda: len(b.owned) == COUNT, LEASE + 2 * RETRY + 1)
                await asyncio.sleep(SETTLE)
            cut.heal()
        await asyncio.gather(runner_a, runner_b)
        runs = check_work([work_a.log, work_b.log])
        assert {s for s, _, who, *_ in runs if who == "b"} == set(range(COUNT))

    run(body)


def test_run_for_each_propagates_an_error_of_fn_and_cancels_the_rest():
    async def body(clock, store):
        started = []
        cancelled = []

        async def work(shard):
            started.append(shard.shard)
            if shard.shard == 3:
                await asyncio.sleep(1.0)
                raise ValueError("shard 3 is broken")
            try:
                await asyncio.sleep(math.inf)
            except asyncio.CancelledError:
                cancelled.append(shard.shard)
                raise

        async def join_and_work():
            async with shards(store, "a") as a:
                await until(lambda: len(a.owned) == COUNT, STABLE)
                await a.run_for_each(work)

        with pytest.raises(ValueError, match="shard 3 is broken"):
            await join_and_work()
        assert sorted(started) == list(range(COUNT))
        assert sorted(cancelled) == [i for i in range(COUNT) if i != 3]
        await asyncio.sleep(SETTLE)
        assert await store_owners(store) == [None] * COUNT

    run(body)


def test_run_for_each_outside_the_block_raises():
    async def body(clock, store):
        async def work(shard):
            pass

        a = shards(store, "a")
        with pytest.raises(MultilockError, match="enter the Shards first"):
            await a.run_for_each(work)
        async with a:
            pass
        with pytest.raises(MultilockError, match="enter the Shards first"):
            await a.run_for_each(work)

        def plain(shard):
            pass

        with pytest.raises(TypeError, match="async function"):
            await a.run_for_each(plain)

    run(body)


def test_run_for_each_returns_when_the_block_ends():
    async def body(clock, store):
        work = Recorder("a")
        a = shards(store, "a")
        async with a:
            runner = asyncio.create_task(a.run_for_each(work))
            await until(lambda: len(a.owned) == COUNT, STABLE)
            await asyncio.sleep(1.0)
        await asyncio.wait_for(runner, SETTLE)
        assert len(work.log) == COUNT
        assert {how for *_, how in work.log} == {"cancelled"}

    run(body)


# ---------------------------------------------------------------------------- leaving


def test_aclose_cancelled_at_any_step_still_releases_everything():
    async def body(clock, store):
        before = other_tasks()
        for steps in range(1, 16):  # (cancelled before its first step, aclose never ran)
            name = f"w{steps}"
            a = shards(store, "a", name=name)
            await a.__aenter__()
            await until(lambda a=a: len(a.owned) == COUNT, STABLE)
            closing = asyncio.create_task(a.aclose())
            for _ in range(steps):
                await asyncio.sleep(0)
            closing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closing
            await asyncio.sleep(SETTLE)  # far less than a lease: released, not expired
            assert await store_owners(store, name=name) == [None] * COUNT, steps
            assert await store_members(store, name=name) == [None] * COUNT, steps
            assert a.owned == {}
            await until(lambda: other_tasks() <= before, LEASE)

    run(body)


def test_leaving_with_the_block_releases_at_once():
    async def body(clock, store):
        before = other_tasks()
        async with shards(store, "a") as a:
            await until(lambda: len(a.owned) == COUNT, STABLE)
        assert await store_owners(store) == [None] * COUNT
        assert await store_members(store) == [None] * COUNT
        await until(lambda: other_tasks() <= before, SETTLE)
        await a.aclose()  # again: nothing to do

    run(body)


def test_entering_twice_raises_and_reentry_after_leaving_works():
    async def body(clock, store):
        a = shards(store, "a")
        async with a:
            with pytest.raises(MultilockError, match="already entered"):
                await a.__aenter__()
            await until(lambda: len(a.owned) == COUNT, STABLE)
        async with a:
            await until(lambda: len(a.owned) == COUNT, STABLE)
            assert all(view.token == 2 for view in a.owned.values())

    run(body)


# ---------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("count", "message"),
    [
        (0, "count must be between 1 and 10000, got 0"),
        (True, "count must be an int, not bool"),
        (2.5, "count must be an int, not float"),
    ],
)
def test_refuses_a_bad_count(count, message):
    with pytest.raises(ConfigurationError, match=message):
        Shards(InMemoryProvider(), "w", count)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group": "x"}, "shards takes no 'group' option"),
        ({"release_on_stop": False}, "shards takes no 'release_on_stop' option"),
        ({"lease_duration": 0.01}, "lease_duration"),
        ({"nonsense": 1}, "nonsense"),
    ],
)
def test_refuses_bad_options(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        Shards(InMemoryProvider(), "w", 4, **kwargs)


def test_refuses_a_bad_provider_or_name():
    with pytest.raises(ConfigurationError, match="provider must be a multilock Provider"):
        Shards(None, "w", 4)
    with pytest.raises(ConfigurationError, match="group"):
        Shards(InMemoryProvider(), "no spaces", 4)


def test_properties_and_repr():
    async def body(clock, store):
        a = shards(store, "a")
        assert (a.name, a.count, a.participant_id) == ("w", COUNT, "a")
        assert (a.share, a.live_participants, a.owned) == (0, 0, {})
        async with a:
            await until(lambda: len(a.owned) == COUNT, STABLE)
            assert (a.share, a.live_participants) == (COUNT, 1)
            assert list(a.owned) == list(range(COUNT))
            text = repr(a)
            assert "'w'" in text
            assert f"count={COUNT}" in text
            assert f"owned={COUNT}" in text
            view = a.owned[5]
            assert view.group == "w.shard-5"
            assert "shard=5" in repr(view)

    run(body)


def test_run_for_each_cancelled_at_any_step_leaves_no_work_and_keeps_the_shards():
    async def body(clock, store):
        running = set()
        started = []

        async def work(shard):
            started.append(shard.shard)
            running.add(shard.shard)
            try:
                await asyncio.sleep(math.inf)
            finally:
                running.discard(shard.shard)

        async with shards(store, "a") as a:
            await until(lambda: len(a.owned) == COUNT, STABLE)
            for steps in [*range(12), None]:  # None: once every shard's work runs
                started.clear()
                runner = asyncio.create_task(a.run_for_each(work))
                if steps is None:
                    await until(lambda: len(started) == COUNT, STABLE)
                for _ in range(steps or 0):
                    await asyncio.sleep(0)
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner
                assert runner.cancelled(), steps
                assert not running, (steps, running)  # every run it started has ended
                assert len(a.owned) == COUNT  # cancelling the work gives no shard up

    run(body)
