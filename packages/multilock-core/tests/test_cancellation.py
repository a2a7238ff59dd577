"""The paths of the "Core 2" issue: cancellation, slow-to-cancel drivers, hold-off, one id.

Each test drives the election in virtual time and fails on the core before the rewrite.
"""

import asyncio
import contextlib
import os
import signal

import pytest

from multilock.core import (
    ElectionState,
    EventKind,
    InMemoryProvider,
    LeaderElection,
    ProviderError,
    probe,
    stop_on_signals,
)
from multilock.core.testing import FakeClock, Fault, FaultyProvider

LEASE = 10.0


class SlowToCancel(FaultyProvider):
    """A store whose chosen calls hang, then take *settle* seconds to honour a cancel.

    psycopg cancelling a query on the server, or a worker thread running to its socket
    timeout, behave like this.
    """

    def __init__(self, inner, settle: float = 300.0) -> None:
        super().__init__(inner)
        self.settle = settle
        self.slow: set[str] = set()

    async def _gate(self, method):
        if method in self.slow:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await asyncio.shield(asyncio.sleep(self.settle))
                raise
        return await super()._gate(method)


def run(body):
    clock = FakeClock()

    async def main():
        store = InMemoryProvider(clock=clock.monotonic)
        return await body(clock, store)

    return clock.run(main())


def election(provider, name, **options):
    options.setdefault("lease_duration", LEASE)
    return LeaderElection(provider, group="g", participant_id=name, **options)


async def leads(election, within):
    """Wait for *election* to lead, at most *within* seconds (virtual)."""
    async with asyncio.timeout(within):
        return await election.wait_until_leader()


async def kinds(stream):
    return [event.kind for event in [e async for e in stream]]


def test_resign_cancelled_while_releasing_still_emits_lost():
    async def body(clock, store):
        faulty = FaultyProvider(store)
        a = election(faulty, "a")
        stream = a.events(EventKind.ACQUIRED | EventKind.LOST)
        await a.start()
        await a.wait_until_leader()
        faulty.inject(Fault.HANG, "release")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):  # a shutdown or a caller's timeout
                await a.resign()
        assert not a.is_leader
        faulty.heal()
        await a.stop()
        assert await kinds(stream) == [EventKind.ACQUIRED, EventKind.LOST]

    run(body)


def test_stop_cancelled_midway_can_be_called_again_and_start_works():
    async def body(clock, store):
        faulty = FaultyProvider(store)
        a = election(faulty, "a")
        await a.start()
        await a.wait_until_leader()
        stream = a.events()
        faulty.inject(Fault.HANG, "release")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.1):
                await a.stop()
        async with asyncio.timeout(LEASE):
            await a.stop()  # completes, and does not raise an illegal transition
        assert a.state is ElectionState.STOPPED
        assert [e.kind async for e in stream] == [EventKind.LOST]  # the stream ended
        faulty.heal()
        clock.advance(LEASE)  # the unreleased lease expires
        await a.start()
        assert (await leads(a, LEASE)).token == 2
        await a.stop()
        assert a.state is ElectionState.STOPPED

    run(body)


def test_current_leader_does_not_wait_for_a_driver_slow_to_cancel():
    async def body(clock, store):
        slow = SlowToCancel(store)
        a = election(slow, "a")
        slow.slow.add("get_leader")
        started = asyncio.get_running_loop().time()
        try:
            await a.current_leader()
        except ProviderError:
            pass
        else:
            raise AssertionError("a hung get_leader returned")
        assert asyncio.get_running_loop().time() - started <= LEASE + 0.01

    run(body)


def test_campaign_is_not_held_up_by_a_driver_slow_to_cancel():
    async def body(clock, store):
        slow = SlowToCancel(store)
        a = election(slow, "a")
        slow.slow.add("try_acquire")
        await a.start()
        await asyncio.sleep(LEASE)
        slow.slow.clear()  # healed: the next round must come within a retry, not a settle
        started = asyncio.get_running_loop().time()
        await leads(a, LEASE)
        assert asyncio.get_running_loop().time() - started <= a.options.retry_interval + 0.01
        await a.stop()

    run(body)


def test_stop_after_an_acquire_in_doubt_does_not_wait_for_a_slow_driver():
    async def body(clock, store):
        slow = SlowToCancel(store)
        a = election(slow, "a")
        slow.slow.add("try_acquire")
        await a.start()
        await asyncio.sleep(0.1)  # the first round is in a hung try_acquire: in doubt
        slow.slow.add("get_leader")  # and the check for an orphaned lease will hang too
        started = asyncio.get_running_loop().time()
        await a.stop()
        assert asyncio.get_running_loop().time() - started <= a.options.renew_interval + 0.01

    run(body)


class RoundTrip(FaultyProvider):
    """A store each call of which takes *rtt* seconds, noting when each call was made."""

    def __init__(self, inner, rtt: float = 0.001) -> None:
        super().__init__(inner)
        self.rtt = rtt
        self.made: list[tuple[str, float]] = []

    async def _gate(self, method):
        self.made.append((method, asyncio.get_running_loop().time()))
        await asyncio.sleep(self.rtt)
        return await super()._gate(method)


@pytest.mark.parametrize("rtt", [0.0, 0.001], ids=["instant store", "1 ms round trips"])
def test_holdoff_never_delays_taking_a_group_another_participant_released(rtt):
    # With round trips, each term ends the moment it begins, while the resigner waits for
    # the notification after its own release's: that notification must end its hold-off.
    async def body(clock, store):
        retry = 5.0
        a = election(RoundTrip(store, rtt) if rtt else store, "a", retry_interval=retry)
        b = election(RoundTrip(store, rtt) if rtt else store, "b", retry_interval=retry)
        await a.start()
        await a.wait_until_leader()
        await b.start()
        loop = asyncio.get_running_loop()
        for _ in range(4):  # ping-pong, far faster than retry_interval
            for leader, other in ((a, b), (b, a)):
                await leads(leader, retry)
                resigned = loop.time()
                await leader.resign()
                await leads(other, retry)
                assert loop.time() - resigned < 0.01, "the hand-back waited for a hold-off"
        await a.stop()
        await b.stop()

    run(body)


class Queueing(RoundTrip):
    """`RoundTrip` on a store that queues candidates (as ZooKeeper does): a try on a held
    group is what puts the caller in line."""

    @property
    def queues_candidates(self) -> bool:
        return True


@pytest.mark.parametrize("queues", [False, True], ids=["leases", "queued candidates"])
def test_a_resigner_does_not_read_the_group_before_its_successor_took_it(queues):
    # Woken by its own release's notification, a resigner used to read the group at once:
    # it found it vacant, and (in one process) that read ran beside the successor's acquire.
    async def body(clock, store):
        kind = Queueing if queues else RoundTrip
        a_store, b_store = kind(store), kind(store)
        a = election(a_store, "a", retry_interval=5.0)
        b = election(b_store, "b", retry_interval=5.0)
        await a.start()
        await leads(a, 5.0)
        await b.start()
        await asyncio.sleep(LEASE / 2)  # a has renewed: it knows the store's round trip
        loop = asyncio.get_running_loop()
        a_store.made.clear()
        await a.resign()
        await leads(b, 1.0)
        began = loop.time()  # b's term began at this (virtual) instant
        await asyncio.sleep(0.1)  # the resigner's rounds after the handoff
        calls = [(method, at) for method, at in a_store.made if method != "watch"]
        assert calls, "the resigner never looked at the group again"
        assert all(at >= began for _, at in calls[1:]), calls  # [0] is its release
        # Woken by the successor's notification, it reads before it tries: on Redlock the
        # successor may still be acquiring on the other nodes. Seeing it lead, it tries
        # only where that queues it behind the leader.
        tried = ["try_acquire"] if queues else []
        assert [method for method, _ in calls] == ["release", "get_leader", *tried]
        assert a.leadership is None
        assert not a._holding_off(), "still holding off"
        await a.stop()
        await b.stop()

    run(body)


def forget(store, group):
    """Drop *group*'s lease from the in-memory *store* and notify, as an operator's delete
    or a store's failover would."""
    with store._store.lock:
        store._store.leases.pop(group, None)
    store._notify(group)


class LateWatch(RoundTrip):
    """`RoundTrip`, its watch yielding each notification *lag* seconds late: the reply to a
    write comes first, then its notification (Redis pub/sub, PostgreSQL NOTIFY)."""

    def __init__(self, inner, lag: float) -> None:
        super().__init__(inner)
        self.lag = lag

    def watch(self, group):
        return self._late(super().watch(group))

    async def _late(self, inner):
        on = False
        async for _ in inner:
            if on:
                await asyncio.sleep(self.lag)
            on = True
            yield None


@pytest.mark.parametrize("lag", [0.0, 0.002], ids=["notified first", "answered first"])
def test_a_new_leader_does_not_renew_for_its_own_acquire_but_for_the_next_notification(lag):
    # The notification of its own acquire, coming after the reply, used to make a new
    # leader renew at once: one write per term for nothing. A notification after that one
    # still ends a dropped term at once.
    async def body(clock, store):
        a_store, b_store = LateWatch(store, lag), LateWatch(store, lag)
        a, b = election(a_store, "a"), election(b_store, "b")
        await a.start()
        await leads(a, 1.0)
        await b.start()
        await asyncio.sleep(LEASE / 2)  # both watches are on, and a has renewed
        for leader, store_of, other in ((b, b_store, a), (a, a_store, b)):
            store_of.made.clear()
            await other.resign()
            await leads(leader, 1.0)
            await asyncio.sleep(LEASE / 10)  # well inside the first renew_interval
            assert [m for m, _ in store_of.made if m != "watch"] == ["try_acquire"]
            await asyncio.sleep(LEASE / 2)  # renewed since: the next resign is fresh
        loop = asyncio.get_running_loop()
        store_of.made.clear()
        dropped = loop.time()
        forget(store, "g")
        async with asyncio.timeout(0.1):
            while leader.is_leader:
                await asyncio.sleep(0.001)
        assert loop.time() - dropped < 0.01 + lag, "the drop waited for the next renew"
        assert [m for m, _ in store_of.made if m != "watch"][:1] == ["renew"]
        await a.stop()
        await b.stop()

    run(body)


class TwoLegs(LateWatch):
    """`LateWatch` whose acquires and reads also take a reply leg: the store acts *rtt* after
    the call and answers *rtt* later, its notification leaving when it acts (so a
    follower refused because another just won hears of that win before the refusal)."""

    async def try_acquire(self, *args):
        result = await super().try_acquire(*args)
        await asyncio.sleep(self.rtt)
        return result

    async def get_leader(self, group):
        result = await super().get_leader(group)
        await asyncio.sleep(self.rtt)
        return result


@pytest.mark.parametrize("lag", [0.0, 0.005], ids=["notified first", "answered first"])
def test_a_follower_beaten_to_the_group_tries_once_per_handoff(lag):
    # When the leader releases, every follower tries at once and one wins. The winner's
    # notification then woke each of the others again, and each tried once more (a write
    # that could only fail) and read once more, although its read had seen the winner.
    # A notification that comes only after the read was sent may announce a change that
    # read did not see: that one is still answered.
    async def body(clock, store):
        stores = {name: TwoLegs(store, lag) for name in "abcd"}
        elections = {name: election(stores[name], name) for name in "abcd"}
        await elections["a"].start()
        await leads(elections["a"], 1.0)
        for name in "bcd":
            await elections[name].start()
        await asyncio.sleep(LEASE / 2)  # every watch is on
        loop, leader = asyncio.get_running_loop(), elections["a"]
        rounds = ["try_acquire", "get_leader"] * (2 if lag else 1)
        for _ in range(6):
            for s in stores.values():
                s.made.clear()
            resigned = loop.time()
            await leader.resign()
            async with asyncio.timeout(1.0):
                while not (won := [e for e in elections.values() if e.is_leader]):
                    await asyncio.sleep(0.0005)
            assert loop.time() - resigned < 0.01 + lag, "the handoff waited"
            await asyncio.sleep(LEASE / 10)  # every follower has settled
            for name, e in elections.items():
                if e is not leader and e is not won[0]:
                    calls = [m for m, _ in stores[name].made if m != "watch"]
                    assert calls == rounds, (name, calls)
            leader = won[0]
            await asyncio.sleep(LEASE / 2)  # past the resigner's hold-off
        for e in elections.values():
            await e.stop()

    run(body)


class SlowToWatch(FaultyProvider):
    """A store whose watches come on *delay* seconds after they are asked for."""

    def __init__(self, inner, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def watch(self, group):
        return self._slow(group)

    async def _slow(self, group):
        await asyncio.sleep(self.delay)
        async for _ in super().watch(group):
            yield None


def test_a_term_won_before_the_watch_was_on_ends_at_the_next_notification():
    # Its acquire, sent before the watch was on, never notifies it: the next notification
    # is another's act, and a dropped lease ends the term at once.
    async def body(clock, store):
        a = election(SlowToWatch(store, 0.05), "a")
        await a.start()
        await leads(a, 0.01)  # before its watch is on
        await asyncio.sleep(LEASE / 10)  # the watch is on; no renew yet
        assert a.statistics().renewals == 0
        loop = asyncio.get_running_loop()
        dropped = loop.time()
        forget(store, "g")
        async with asyncio.timeout(0.1):
            while a.is_leader:
                await asyncio.sleep(0.001)
        assert loop.time() - dropped < 0.01, "the drop waited for the next renew"
        await a.stop()

    run(body)


class HeldWatch(FaultyProvider):
    """A store whose watches, while held, keep their notifications; let go, each yields
    once per notification it kept, back to back, as when several messages are read from
    one packet or the loop was busy."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.open = asyncio.Event()
        self.open.set()

    def watch(self, group):
        return self._held(self.inner.watch(group))

    async def _held(self, inner):
        kept: asyncio.Queue[None] = asyncio.Queue()

        async def pump():
            async for _ in inner:
                kept.put_nowait(None)

        pumping = asyncio.ensure_future(pump())
        try:
            while True:
                await kept.get()
                await self.open.wait()
                yield None
                while not kept.empty():
                    kept.get_nowait()
                    yield None
        finally:
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pumping


def test_a_resigner_takes_back_a_group_its_successor_gave_up_before_it_looked():
    # The resigner's notifications come together: its own release's, its successor's new
    # term's and that term's release's. Taking that one wake-up for its own release's
    # alone, it held off its whole retry_interval while the group stood vacant (the
    # successor holding off too, having resigned).
    async def body(clock, store):
        retry = 5.0
        held = HeldWatch(store)
        a = election(held, "a", retry_interval=retry)
        b = election(store, "b", retry_interval=retry)
        await a.start()
        await leads(a, 1.0)
        await b.start()
        await asyncio.sleep(LEASE / 2)  # both watches are on
        held.open.clear()
        await a.resign()
        await leads(b, 1.0)
        await b.resign()
        await asyncio.sleep(0.01)
        assert await store.get_leader("g") is None
        loop = asyncio.get_running_loop()
        let_go = loop.time()
        held.open.set()
        await leads(a, retry)
        assert loop.time() - let_go < 0.01, "the resigner held off with the group vacant"
        await a.stop()
        await b.stop()

    run(body)


def test_two_elections_with_one_participant_id_never_both_lead():
    async def body(clock, store):
        # Two processes configured with the same id: each has its own provider.
        first = election(InMemoryProvider(clock=clock.monotonic, store_name="one-id"), "pod-1")
        second = election(InMemoryProvider(clock=clock.monotonic, store_name="one-id"), "pod-1")
        await first.start()
        await first.wait_until_leader()
        await second.start()
        for _ in range(int(3 * LEASE / 0.05)):
            await asyncio.sleep(0.05)
            assert not (first.is_leader and second.is_leader), "two leaders with one id"
            assert first.is_leader
        await first.stop()
        taken = await leads(second, LEASE)
        assert taken.token == 2  # a term of its own, not the first one's
        await second.stop()

    run(body)


def test_a_lost_acquire_reply_is_taken_up_as_our_own_term():
    async def body(clock, store):
        faulty = FaultyProvider(store)
        original = store.try_acquire

        async def applied_then_lost(*args):
            await original(*args)  # the write is applied, the reply never comes
            raise ProviderError("connection reset after the write")

        faulty.inner.try_acquire = applied_then_lost
        a = election(faulty, "a")
        events = a.events(EventKind.ACQUIRED)
        await a.start()
        await asyncio.sleep(a.options.retry_interval)
        faulty.inner.try_acquire = original
        leadership = await leads(a, LEASE)
        assert leadership.token == 1  # the term the lost reply created, not a second one
        await a.stop()
        assert [e.token async for e in events] == [1]
        assert await store.get_leader("g") is None  # released on stop

    run(body)


def test_leader_info_shown_to_users_has_no_instance_nonce():
    async def body(clock, store):
        a = election(store, "a", metadata={"zone": "eu"})
        events = a.events(EventKind.ACQUIRED)
        await a.start()
        leadership = await a.wait_until_leader()
        assert dict(leadership.metadata) == {"zone": "eu"}
        info = await a.current_leader()
        assert info is not None
        assert dict(info.metadata) == {"zone": "eu"}
        stored = await store.get_leader("g")
        assert stored is not None
        assert "multilock.instance" in stored.metadata
        await a.stop()
        assert [dict(e.leader.metadata) async for e in events] == [{"zone": "eu"}]

    run(body)


def test_a_release_never_overtakes_its_terms_renew_in_flight():
    # On a store that checks versions (S3 ETags, Azure), a release sent while the term's
    # renew is in flight reads the record before the renew rewrites it, and is refused:
    # the lease then lives on until it expires, and a waiting candidate waits for it.
    async def body(clock, store):
        log = []

        class SlowRenew(FaultyProvider):
            async def renew(self, *args):
                log.append("renew sent")
                await asyncio.sleep(0.5)
                ok = await super().renew(*args)
                log.append("renew answered")
                return ok

            async def release(self, *args):
                log.append("release sent")
                await super().release(*args)

        a = election(SlowRenew(store), "a")
        await a.start()
        await a.wait_until_leader()
        while log[-1:] != ["renew sent"]:
            await asyncio.sleep(0.01)
        await a.resign()
        assert log[-3:] == ["renew sent", "renew answered", "release sent"]
        assert await store.get_leader("g") is None
        await a.stop()

    run(body)


# ---------------------------------------------------------------- a caller cancelled
# Each test cancels the caller at an await point and checks what is left: the state, the
# tasks, the signal handlers, the lease.


def others() -> set[asyncio.Task]:
    """The loop's tasks but the test's own."""
    return asyncio.all_tasks() - {asyncio.current_task()}


async def until(condition, within: float = LEASE) -> None:
    """Wait for *condition*, at most *within* seconds (virtual)."""
    async with asyncio.timeout(within):
        while not condition():
            await asyncio.sleep(0.01)


async def cancelled(task: asyncio.Task) -> float:
    """Cancel *task*, wait for it to end cancelled; return the (virtual) seconds it took."""
    loop = asyncio.get_running_loop()
    asked = loop.time()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return loop.time() - asked


def test_start_cancelled_mid_probe_leaves_the_election_idle_and_startable():
    async def body(clock, store):
        slow = SlowToCancel(store)
        slow.slow.add("get_leader")
        a = election(slow, "a", probe_timeout=LEASE)
        starting = asyncio.ensure_future(a.start())
        await asyncio.sleep(1)  # in the probe
        assert not starting.done()
        assert await cancelled(starting) < 0.01, "held by the driver's slow cancel"
        assert a.state is ElectionState.IDLE
        assert not a.is_leader
        assert not [t for t in others() if t.get_name().startswith("multilock-")]
        await a.stop()  # stoppable: a no-op
        assert a.state is ElectionState.IDLE

        await asyncio.sleep(slow.settle + 1)  # the abandoned get_leader settles
        assert not others(), "a task was left behind"
        slow.slow.clear()
        await a.start()  # starts again, probe and all
        assert (await leads(a, LEASE)).token == 1
        await a.stop()
        assert a.state is ElectionState.STOPPED
        assert await store.get_leader("g") is None

    run(body)


def test_probe_cancelled_leaves_no_task_behind():
    async def body(clock, store):
        hung = FaultyProvider(store)
        hung.inject(Fault.HANG, "get_leader")
        probing = asyncio.ensure_future(probe(hung, "g", timeout=LEASE))
        await asyncio.sleep(1)
        assert await cancelled(probing) < 0.01
        await asyncio.sleep(0)  # the abandoned call's cancel is delivered
        assert not others(), "a task was left behind"

        slow = SlowToCancel(store)
        slow.slow.add("get_leader")
        probing = asyncio.ensure_future(probe(slow, "g", timeout=LEASE))
        await asyncio.sleep(1)
        assert await cancelled(probing) < 0.01, "held by the driver's slow cancel"
        await asyncio.sleep(slow.settle + 1)  # the abandoned call settles
        assert not others(), "a task was left behind"

    run(body)


def test_stop_on_signals_exit_cancelled_restores_the_handlers_and_the_election_stops():
    async def body(clock, store):
        slow = SlowToCancel(store)
        a = election(slow, "a")
        before = signal.getsignal(signal.SIGUSR1)
        scope = stop_on_signals(signals=[signal.SIGUSR1])

        async def program():
            async with scope:
                await a.start()
                await a.wait_until_leader()
                slow.slow.add("release")  # stopping will take a while
                os.kill(os.getpid(), signal.SIGUSR1)
                await until(lambda: a.state is ElectionState.STOPPING)
                # The body ends on its own: leaving waits for the elections to stop.

        main = asyncio.ensure_future(program())
        await until(lambda: a.state is ElectionState.STOPPING)
        await asyncio.sleep(0.1)  # main is in __aexit__, waiting for the stop
        assert not main.done()
        assert await cancelled(main) < 0.01
        assert scope.received is signal.SIGUSR1
        assert signal.getsignal(signal.SIGUSR1) == before, "the handler was not restored"
        assert a.state is ElectionState.STOPPING  # the stop goes on without the caller
        async with asyncio.timeout(a.options.renew_interval + 0.01):
            await a.stop()  # stoppable: waits for the shutdown in progress, bounded
        assert a.state is ElectionState.STOPPED
        assert not a.is_leader
        slow.slow.clear()
        clock.advance(LEASE)  # the release was given up on: the lease expires
        assert await store.get_leader("g") is None
        b = election(store, "b")
        await b.start()
        await leads(b, 0.01)
        await b.stop()

    run(body)


class CancelsItself(InMemoryProvider):
    """A driver that cancels its own call now and then (gRPC does, on a closing channel)."""

    def __init__(self, clock) -> None:
        super().__init__(clock=clock)
        self.cancel_next = 0

    async def get_leader(self, group):
        if self.cancel_next:
            self.cancel_next -= 1
            raise asyncio.CancelledError
        return await super().get_leader(group)

    async def try_acquire(self, group, participant_id, lease_duration, metadata):
        if self.cancel_next:
            self.cancel_next -= 1
            raise asyncio.CancelledError
        return await super().try_acquire(group, participant_id, lease_duration, metadata)


def test_a_driver_cancelling_its_own_call_is_a_failed_call_not_the_end_of_the_election():
    clock = FakeClock()

    async def main():
        store = CancelsItself(clock.monotonic)
        store.cancel_next = 3
        async with election(store, "a") as a:
            leadership = await a.wait_until_leader(timeout=3 * LEASE)
            assert leadership.token >= 1
            assert a.statistics().acquire_failures >= 1
        assert a.state is ElectionState.STOPPED

    clock.run(main())
