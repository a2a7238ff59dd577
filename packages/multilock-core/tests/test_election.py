"""The election state machine on the in-memory provider, in virtual time: nothing sleeps."""

import asyncio
import itertools

import pytest

from multilock.core import (
    ConfigurationError,
    ElectionOptions,
    ElectionState,
    EventKind,
    InMemoryProvider,
    LeaderElection,
    LeadershipLost,
    MultilockError,
    RunStatus,
    on_transition,
    until_leader,
    watch_leader,
    while_leader,
)
from multilock.core.provider import LeaseBounds
from multilock.core.testing import FakeClock, Fault, FaultyProvider, check_timeline

LEASE = 10.0


class World:
    """One store, a fake clock, and a recorder of every election's events."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.store = InMemoryProvider(clock=clock.monotonic)
        self.records: list[dict] = []
        self.elections: list[LeaderElection] = []
        self._tasks: list[asyncio.Task] = []

    def election(self, name, *, provider=None, **options):
        options.setdefault("lease_duration", LEASE)
        election = LeaderElection(provider or self.store, group="g", participant_id=name, **options)
        self.elections.append(election)
        self._tasks.append(asyncio.ensure_future(self._record(election, election.events())))
        return election

    async def _record(self, election, stream):
        async for event in stream:
            record = {
                "t": self.clock.now,
                "participant": election.participant_id,
                "event": event.kind.name.lower(),
                "token": event.token,
            }
            if event.kind is EventKind.LOST:
                record["valid_until"] = self.clock.now
            self.records.append(record)

    def kinds(self, name):
        return [r["event"] for r in self.records if r["participant"] == name]

    def check(self):
        report = check_timeline([r for r in self.records if r["event"] in ("acquired", "lost")])
        report.assert_ok()
        return report

    async def close(self):
        for election in self.elections:
            await election.stop()
        await asyncio.gather(*self._tasks)


def run(test):
    """Run ``test(world)`` in virtual time."""
    clock = FakeClock()

    async def main():
        world = World(clock)
        try:
            return await test(world)
        finally:
            await world.close()

    return clock.run(main())


async def sample_single_leader(elections, seconds, step=0.01):
    """Check at fine steps of virtual time that never two elections lead at once."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        leaders = [e.participant_id for e in elections if e.is_leader]
        assert len(leaders) <= 1, f"two leaders at {loop.time():.3f}: {leaders}"
        await asyncio.sleep(step)


def test_single_election_leads_and_renews():
    async def body(world):
        a = world.election("a")
        await a.start()
        leadership = await a.wait_until_leader()
        assert a.is_leader
        assert a.state is ElectionState.LEADING
        assert leadership.token == 1
        assert leadership.group == "g"
        await asyncio.sleep(LEASE * 5)
        assert a.is_leader
        assert a.leadership is leadership
        stats = a.statistics()
        assert stats.renewals >= 14
        assert stats.renew_failures == 0
        assert stats.terms_won == 1
        assert stats.time_as_leader == pytest.approx(LEASE * 5, abs=0.1)

    run(body)


@pytest.mark.parametrize("fault", [Fault.HANG, Fault.RAISE])
def test_leader_steps_down_before_the_lease_can_pass_on(fault):
    async def body(world):
        faulty = FaultyProvider(world.store)
        a = world.election("a", provider=faulty)
        b = world.election("b")
        await a.start()
        await a.wait_until_leader()
        await b.start()
        await asyncio.sleep(LEASE)
        faulty.inject(fault)  # a is cut off from the store
        checker = asyncio.ensure_future(sample_single_leader([a, b], LEASE * 3))
        leadership = await b.wait_until_leader()
        assert not a.is_leader
        await checker
        report = world.check()
        assert len(report.intervals) == 2
        assert report.intervals[0].participant == "a"
        last = report.intervals[-1]
        assert (last.participant, last.ended_by) == ("b", "open"), report.describe()
        assert all(gap > 0 for gap in report.gaps)
        assert leadership.token == report.intervals[-1].token

    run(body)


def test_refused_renew_ends_the_term_at_once():
    async def body(world):
        faulty = FaultyProvider(world.store)
        a = world.election("a", provider=faulty)
        await a.start()
        leadership = await a.wait_until_leader()
        start = world.clock.now
        faulty.inject(Fault.REFUSE, "renew")
        while a.is_leader:
            await asyncio.sleep(0.01)
        assert world.clock.now - start <= a.options.renew_interval + 0.02
        assert leadership.lost.is_set()
        with pytest.raises(LeadershipLost, match="token=1"):
            leadership.check()

    run(body)


def test_hung_renew_steps_down_exactly_at_the_deadline():
    async def body(world):
        faulty = FaultyProvider(world.store)
        a = world.election("a", provider=faulty)
        await a.start()
        leadership = await a.wait_until_leader()
        await asyncio.sleep(1)
        faulty.inject(Fault.HANG)
        deadline = leadership.deadline
        assert deadline - world.clock.now < LEASE
        while a.is_leader:
            await asyncio.sleep(0.001)
        assert world.clock.now == pytest.approx(deadline, abs=0.002)
        # The store still holds the lease a little longer: we stepped down first.
        assert await world.store.get_leader("g") is not None
        await asyncio.sleep(0.01)
        assert world.kinds("a")[-1] == "lost"

    run(body)


def test_cut_off_leader_and_follower_never_both_lead():
    async def body(world):
        pa, pb = FaultyProvider(world.store), FaultyProvider(world.store)
        a, b = world.election("a", provider=pa), world.election("b", provider=pb)
        await a.start()
        await a.wait_until_leader()
        await b.start()
        checker = asyncio.ensure_future(sample_single_leader([a, b], LEASE * 24, step=0.05))
        for round_ in range(6):
            leader, provider = (a, pa) if a.is_leader else (b, pb)
            assert leader.is_leader, f"round {round_}: nobody leads"
            provider.inject(Fault.HANG if round_ % 2 else Fault.RAISE)
            await asyncio.sleep(LEASE * 2)
            provider.heal()
            await asyncio.sleep(LEASE * 2)
        await checker
        report = world.check()
        assert len(report.intervals) >= 6
        tokens = [i.token for i in report.intervals]
        assert tokens == sorted(set(tokens))

    run(body)


def test_follower_takes_over_within_lease_plus_retry_after_a_crash():
    async def body(world):
        faulty = FaultyProvider(world.store)
        a, b = world.election("a", provider=faulty), world.election("b")
        await a.start()
        await a.wait_until_leader()
        await b.start()
        await asyncio.sleep(3)
        crash = world.clock.now
        faulty.inject(Fault.HANG)  # a crashed: it never talks to the store again
        await b.wait_until_leader()
        assert world.clock.now - crash <= LEASE + b.options.retry_interval

    run(body)


def test_start_after_stop_works_and_stop_is_idempotent():
    async def body(world):
        a = world.election("a")
        await a.stop()  # never started: nothing happens
        await a.start()
        await a.start()
        first = await a.wait_until_leader()
        await a.stop()
        await a.stop()
        assert a.state is ElectionState.STOPPED
        assert not a.is_leader
        assert await world.store.get_leader("g") is None  # released on stop
        await a.start()
        second = await a.wait_until_leader()
        assert second.token > first.token
        assert first.lost.is_set()
        assert not second.lost.is_set()

    run(body)


def test_release_on_stop_false_keeps_the_lease_until_it_expires():
    async def body(world):
        a = world.election("a", release_on_stop=False)
        await a.start()
        leadership = await a.wait_until_leader()
        await a.stop()
        leader = await world.store.get_leader("g")
        assert leader is not None
        assert leader.token == leadership.token
        await asyncio.sleep(0.01)  # let the recorder drain the stream
        assert world.kinds("a") == ["acquired", "leader_changed", "lost"]

    run(body)


def test_rapid_start_stop_cycles_leave_nothing_behind():
    async def body(world):
        baseline = asyncio.all_tasks()
        a = LeaderElection(world.store, group="cycles", participant_id="a", lease_duration=LEASE)
        b = LeaderElection(world.store, group="cycles", participant_id="b", lease_duration=LEASE)
        await b.start()
        streams = []
        for i in range(100):
            streams.append(a.events())
            await a.start()
            if i % 3 == 0:
                await asyncio.sleep(0)
            if i % 7 == 0:
                await asyncio.sleep(0.5)
            await a.stop()
        await b.stop()
        await asyncio.sleep(0)
        assert asyncio.all_tasks() - baseline == set()
        assert a._hub.subscriber_count == 0
        assert b._hub.subscriber_count == 0
        assert world.store._store.watchers == {}
        for stream in streams:  # every stream ended when the election stopped
            async for _ in stream:
                pass

    run(body)


def test_no_duplicate_or_no_op_events():
    async def body(world):
        a, b = world.election("a"), world.election("b")
        await a.start()
        await a.wait_until_leader()
        await b.start()
        await asyncio.sleep(LEASE * 20)  # many renewals, many follower wakes
        await a.resign()
        await b.wait_until_leader()
        await asyncio.sleep(LEASE * 5)
        await b.stop()
        await a.wait_until_leader()
        await asyncio.sleep(LEASE)
        assert world.kinds("a") == [
            "acquired",
            "leader_changed",
            "lost",
            "leader_changed",
            "acquired",
            "leader_changed",
        ]
        assert world.kinds("b") == ["leader_changed", "acquired", "leader_changed", "lost"]
        for name in "ab":
            events = [(r["event"], r["token"]) for r in world.records if r["participant"] == name]
            assert all(x != y for x, y in itertools.pairwise(events)), events

    run(body)


def test_events_can_be_filtered_and_carry_tokens():
    async def body(world):
        a = world.election("a")
        lost_only = a.events(EventKind.LOST)
        both = a.events(EventKind.ACQUIRED | EventKind.LOST)
        await a.start()
        leadership = await a.wait_until_leader()
        await a.stop()
        assert [e.kind async for e in lost_only] == [EventKind.LOST]
        events = [e async for e in both]
        assert [e.kind for e in events] == [EventKind.ACQUIRED, EventKind.LOST]
        assert all(e.token == leadership.token for e in events)
        assert events[0].leader is not None
        assert events[0].leader.participant_id == "a"
        assert events[1].leader is None
        assert events[1].at >= events[0].at

    run(body)


def test_run_while_leader_cancels_on_loss_and_runs_again_next_term():
    async def body(world):
        faulty = FaultyProvider(world.store)
        a, b = world.election("a", provider=faulty), world.election("b")
        runs: list[tuple[int, str]] = []

        async def work(leadership, label):
            runs.append((leadership.token, f"start-{label}"))
            try:
                await asyncio.sleep(1e9)
            except asyncio.CancelledError:
                runs.append((leadership.token, f"cancelled-valid={leadership.is_valid}"))
                raise

        await a.start()
        runner = asyncio.ensure_future(a.run_while_leader(work, "x"))
        await a.wait_until_leader()
        await asyncio.sleep(1)
        await b.start()
        faulty.inject(Fault.HANG)
        await b.wait_until_leader()
        faulty.heal()
        await b.stop()
        await asyncio.sleep(LEASE)
        assert a.is_leader
        await a.stop()
        await runner  # returns once the election stops
        assert runs == [
            (1, "start-x"),
            (1, "cancelled-valid=False"),
            (3, "start-x"),
            (3, "cancelled-valid=False"),
        ]

    run(body)


def test_run_while_leader_waits_for_the_term_end_when_work_returns():
    async def body(world):
        a = world.election("a")
        calls = []

        async def work(leadership):
            calls.append(leadership.token)

        await a.start()
        runner = asyncio.ensure_future(a.run_while_leader(work))
        await asyncio.sleep(LEASE * 3)
        assert calls == [1]
        await a.resign()
        await asyncio.sleep(LEASE)
        assert calls == [1, 2]
        await a.stop()
        await runner

    run(body)


def test_run_while_leader_resigns_and_raises_when_work_fails():
    async def body(world):
        a, b = world.election("a"), world.election("b")

        async def work(leadership):
            raise RuntimeError("boom")

        await a.start()
        await a.wait_until_leader()
        await b.start()
        with pytest.raises(RuntimeError, match="boom"):
            await a.run_while_leader(work)
        assert not a.is_leader
        await b.wait_until_leader()

    run(body)


def test_run_while_leader_needs_a_running_election():
    async def body(world):
        async def work(leadership):
            return None

        with pytest.raises(MultilockError, match="start it first"):
            await world.election("a").run_while_leader(work)

    run(body)


def test_run_if_leader_tells_not_leader_completed_and_lost_apart():
    async def body(world):
        faulty = FaultyProvider(world.store)
        a = world.election("a", provider=faulty)
        b = world.election("b")

        async def quick(leadership, x):
            return x * 2

        async def slow(leadership):
            await asyncio.sleep(LEASE * 5)
            return "finished"

        await a.start()
        await a.wait_until_leader()
        await b.start()
        not_leader = await b.run_if_leader(quick, 1)
        assert not_leader.status is RunStatus.NOT_LEADER
        assert not not_leader.completed
        done = await a.run_if_leader(quick, 21)
        assert done.status is RunStatus.COMPLETED
        assert done.value == 42
        assert done.completed
        faulty.inject(Fault.RAISE)
        lost = await a.run_if_leader(slow)
        assert lost.status is RunStatus.LOST
        assert lost.value is None

    run(body)


def test_resign_hands_over_to_a_waiting_candidate_at_once():
    async def body(world):
        a, b = world.election("a"), world.election("b")
        await a.start()
        await a.wait_until_leader()
        await b.start()
        await asyncio.sleep(LEASE * 2)
        before = world.clock.now
        await a.resign()
        leadership = await b.wait_until_leader()
        assert world.clock.now - before < 0.01  # notified, not polled
        assert leadership.token == 2
        assert not a.is_leader
        await asyncio.sleep(LEASE * 3)
        assert b.is_leader
        assert not a.is_leader
        await a.resign()  # not leading: no-op
        assert world.kinds("a").count("lost") == 1

    run(body)


def test_resign_without_competitor_leads_again_after_retry_interval():
    async def body(world):
        a = world.election("a")
        await a.start()
        await a.wait_until_leader()
        await a.resign()
        assert not a.is_leader
        start = world.clock.now
        leadership = await a.wait_until_leader()
        assert world.clock.now - start == pytest.approx(a.options.retry_interval, abs=0.01)
        assert leadership.token == 2

    run(body)


def test_lost_term_is_never_silently_resumed():
    """After stepping down while cut off, the next term gets a fresh token."""

    async def body(world):
        faulty = FaultyProvider(world.store)
        a = world.election("a", provider=faulty, lease_duration=LEASE, max_clock_drift=0.2)
        await a.start()
        first = await a.wait_until_leader()
        faulty.inject(Fault.RAISE, "renew")
        while a.is_leader:
            await asyncio.sleep(0.01)
        faulty.heal()
        # The store still shows a's old term (drift margin): a must not resume it.
        second = await a.wait_until_leader()
        assert second.token > first.token

    run(body)


def test_wait_until_leader_fails_when_stopped():
    async def body(world):
        a, b = world.election("a"), world.election("b")
        with pytest.raises(MultilockError, match="idle"):
            await b.wait_until_leader()
        await a.start()
        await a.wait_until_leader()
        await b.start()
        waiter = asyncio.ensure_future(b.wait_until_leader())
        await asyncio.sleep(1)
        await b.stop()
        with pytest.raises(MultilockError, match="is stopp"):
            await waiter

    run(body)


def test_stop_during_a_hung_acquire_returns_and_leaves_nothing():
    async def body(world):
        faulty = FaultyProvider(world.store)
        a = world.election("a", provider=faulty)
        faulty.inject(Fault.HANG, "try_acquire")
        await a.start()
        await asyncio.sleep(1)
        await a.stop()
        assert a.state is ElectionState.STOPPED
        assert await world.store.get_leader("g") is None

    run(body)


def test_current_leader_and_statistics():
    async def body(world):
        a, b = world.election("a", metadata={"host": "h1"}), world.election("b")
        assert await b.current_leader() is None
        await a.start()
        await a.wait_until_leader()
        leader = await b.current_leader()
        assert leader is not None
        assert leader.participant_id == "a"
        assert leader.metadata == {"host": "h1"}
        stats = b.statistics()
        assert stats.state is ElectionState.IDLE
        assert not stats.is_leader
        assert stats.token is None

    run(body)


def test_follower_without_notifications_polls_at_retry_interval():
    class NoWatch(InMemoryProvider):
        def watch(self, group):
            return None

    async def body(world):
        store = NoWatch(clock=world.clock.monotonic)
        store._store = world.store._store
        counted = FaultyProvider(store)
        a, b = world.election("a"), world.election("b", provider=counted)
        await a.start()
        await a.wait_until_leader()
        await b.start()
        await asyncio.sleep(100)
        polls = counted.calls["get_leader"]
        retry = b.options.retry_interval
        assert 100 / retry <= polls <= 100 / (retry * 0.75) + 2

    run(body)


def test_idle_follower_with_notifications_costs_one_read_per_two_leases():
    async def body(world):
        counted = FaultyProvider(world.store)
        a, b = world.election("a"), world.election("b", provider=counted)
        await a.start()
        await a.wait_until_leader()
        await b.start()
        await asyncio.sleep(LEASE * 30)
        # The first rounds try to acquire at once (a try and a look each); then the watch
        # sleeps through the leader's renewals, and only the safety net (a look every two
        # leases, jittered down by up to a quarter) reads.
        assert counted.calls["try_acquire"] <= 2  # the first round, and the watch's first yield
        assert counted.calls["get_leader"] <= 1 + 30 / (2 * 0.75) + 1, counted.calls

    run(body)


def test_options_or_fields_not_both():
    store = InMemoryProvider()
    with pytest.raises(ConfigurationError, match="not both"):
        LeaderElection(store, ElectionOptions(), group="x")
    with pytest.raises(ConfigurationError, match="unknown election option"):
        LeaderElection(store, lease=3)
    with pytest.raises(ConfigurationError, match="must be a multilock Provider"):
        LeaderElection(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="must be an ElectionOptions"):
        LeaderElection(store, {"group": "x"})  # type: ignore[arg-type]


def test_provider_declares_the_leases_it_can_hold():
    class Picky(InMemoryProvider):
        lease_bounds = LeaseBounds(minimum=15, maximum=60, reason="picky leases")

    with pytest.raises(
        ConfigurationError,
        match=r"lease_duration=5 s is out of range for Picky: use 15 to 60 s \(picky leases\)",
    ):
        LeaderElection(Picky(), lease_duration=5)
    with pytest.raises(ConfigurationError, match="use 15 to 60 s"):
        LeaderElection(Picky(), lease_duration=61)
    LeaderElection(Picky(), lease_duration=20)
    LeaderElection(Picky(), lease_duration=60)


def test_stream_helpers():
    async def body(world):
        a, b = world.election("a"), world.election("b")
        stream = a.events()
        seen = []

        async def callbacks():
            await on_transition(
                b.events(),
                on_acquired=lambda e: seen.append(("acquired", e.token)),
                on_lost=lambda e: seen.append(("lost", e.token)),
            )

        watcher = asyncio.ensure_future(callbacks())
        await a.start()
        assert (await until_leader(stream)).token == 1
        await b.start()
        await a.resign()
        assert (await while_leader(stream)).token == 1
        await b.wait_until_leader()
        await b.stop()
        await watcher
        assert seen == [("acquired", 2), ("lost", 2)]
        await a.stop()
        assert await until_leader(stream) is None

    run(body)


def test_watch_leader_reports_every_change_and_only_changes():
    async def body(world):
        seen = []

        async def observe():
            async for info in watch_leader(world.store, "g"):
                seen.append(None if info is None else (info.participant_id, info.token))
                if seen[-2:] == [("b", 2), None]:
                    return

        observer = asyncio.ensure_future(observe())
        a, b = world.election("a"), world.election("b")
        await asyncio.sleep(1)
        await a.start()
        await a.wait_until_leader()
        await asyncio.sleep(LEASE * 3)
        await b.start()
        await a.stop()
        await b.wait_until_leader()
        await b.stop()
        async with asyncio.timeout(LEASE):
            await observer
        # Between a's release and b's acquisition the observer may or may not catch the
        # instant when nobody leads; every change it reports is real and reported once.
        assert seen[:2] == [None, ("a", 1)]
        assert seen[2:] in ([None, ("b", 2), None], [("b", 2), None])

    run(body)


def test_a_watch_wake_makes_the_leader_check_its_lease_at_once():
    """A session-based store (ZooKeeper SUSPENDED, etcd lease gone) ends the term at once."""

    async def body(world):
        a = world.election("a", lease_duration=30)
        await a.start()
        leadership = await a.wait_until_leader()
        await asyncio.sleep(1)
        # The store drops a's lease behind its back and notifies watchers.
        world.store._store.leases.pop("g")
        dropped = world.clock.now
        world.store._notify("g")
        while a.is_leader:
            await asyncio.sleep(0.001)
        assert world.clock.now - dropped < 0.01  # not at the next renew, 10 s later
        assert leadership.lost.is_set()

    run(body)


class SlowPolling(InMemoryProvider):
    """A store without notifications whose watch polls every `poll` seconds."""

    def __init__(self, poll, **kwargs):
        super().__init__(**kwargs)
        self.poll = poll

    @property
    def notify_delay(self):
        return self.poll

    def watch(self, group):
        return self._poll_watch()

    async def _poll_watch(self):
        while True:
            await asyncio.sleep(self.poll)
            yield None


def test_resign_hands_over_on_a_store_that_polls_slower_than_retry_interval():
    async def body(world):
        def polling():
            provider = SlowPolling(5.0, clock=world.clock.monotonic)
            provider._store = world.store._store
            return provider

        a = world.election("a", provider=polling())
        b = world.election("b", provider=polling())
        await a.start()
        await a.wait_until_leader()
        await b.start()
        leader, other = a, b
        for round_ in range(6):
            await asyncio.sleep(1.3 * round_ + 0.1)  # resign at every phase of the polls
            await leader.resign()
            async with asyncio.timeout(a.options.retry_interval + 5.0 + 1):
                await other.wait_until_leader()
            assert not leader.is_leader, f"round {round_}: the resigner took the term back"
            leader, other = other, leader

    run(body)
