"""Tests of the blocking ``with`` forms: `multilock.core.sync.Lock`, `Semaphore`, `Shards`.

Everything runs in virtual time, as in test_sync.py: each test's `FakeClock` drives one
event loop thread (``loop_factory=clock.new_event_loop``, shared by the objects made with
it) and judges expiry in the `InMemoryProvider`. Threads are awaited on events with
real-time deadlines (``WAIT``), never slept on. That a waiter is still kept out is shown
by a second waiter whose ``timeout`` (virtual seconds) runs out meanwhile. The ``clock``,
``store``, ``background`` and ``loop_thread`` fixtures are in conftest.py.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from multilock.core import (
    AcquireTimeout,
    ConfigurationError,
    InMemoryProvider,
    Leadership,
    LeadershipLost,
    MultilockError,
    Provider,
    SemaphoreSlot,
    ShardLeadership,
    available_schemes,
)
from multilock.core.sync import Lock, Semaphore, Shards
from multilock.core.testing import FakeClock, Fault, FaultyProvider

if TYPE_CHECKING:
    from conftest import Background, LoopThread

pytestmark = pytest.mark.timeout(30)

#: Real seconds a thread may take to report back; a bound, never a sleep.
WAIT = 5.0
#: Virtual seconds.
LEASE = 15.0
NAME = "job"


class Holder:
    """Hold *holder* in a thread: the block stays open until ``release`` is set; the
    result is what the block saw: the held object and whether ``lost`` was set inside."""

    def __init__(self, holder: Lock | Semaphore, background: type[Background]) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.held: Any = None
        self.result = background(self._body, holder).result

    def _body(self, holder: Lock | Semaphore) -> tuple[Any, bool]:
        with holder as held:
            self.held = held
            self.entered.set()
            assert self.release.wait(WAIT)
            return held, held.lost.is_set()

    def wait_entered(self) -> Any:
        assert self.entered.wait(WAIT), "the holder did not get in"
        return self.held


class Factory:
    """Make sync objects on one virtual-time loop and one store; close them at teardown."""

    def __init__(self, clock: FakeClock, store: InMemoryProvider) -> None:
        self.clock = clock
        self.store = store
        self.made: list[Lock | Semaphore | Shards] = []

    def _fields(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs.setdefault("lease_duration", LEASE)
        return {"loop_factory": self.clock.new_event_loop, **kwargs}

    def lock(self, provider: Provider | str | None = None, **kwargs: Any) -> Lock:
        made = Lock(provider or self.store, NAME, **self._fields(kwargs))
        self.made.append(made)
        return made

    def semaphore(self, limit: int, **kwargs: Any) -> Semaphore:
        made = Semaphore(self.store, NAME, limit, **self._fields(kwargs))
        self.made.append(made)
        return made

    def shards(self, count: int, provider: Provider | str | None = None, **kwargs: Any) -> Shards:
        made = Shards(provider or self.store, NAME, count, **self._fields(kwargs))
        self.made.append(made)
        return made

    def close(self) -> None:
        for made in reversed(self.made):
            made.close()


@pytest.fixture
def make(clock: FakeClock, store: InMemoryProvider) -> Iterator[Factory]:
    factory = Factory(clock, store)
    yield factory
    factory.close()


Hold = Callable[[Lock | Semaphore], Holder]


@pytest.fixture
def hold(background: type[Background]) -> Hold:
    """``hold(lock)`` enters *lock* in a thread of its own (a `Holder`)."""
    return lambda holder: Holder(holder, background)


def still_held(holder: Lock | Semaphore) -> None:
    """A waiter with a timeout of three leases gets nothing: what it waits for stays held."""
    with pytest.raises(AcquireTimeout, match="not acquired within 45 s"), holder:
        pytest.fail("acquired what is held")


# ---------------------------------------------------------------------- Lock
def test_one_lock_excludes_threads_and_tokens_rise(make: Factory, hold: Hold) -> None:
    lock = make.lock()
    first, second = hold(lock), None
    held = first.wait_entered()
    assert isinstance(held, Leadership)
    assert held.group == NAME
    assert held.is_valid
    second = hold(lock)  # the same object from another thread: a separate holder
    still_held(make.lock(timeout=3 * LEASE))
    assert not second.entered.is_set()
    assert "held=1" in repr(lock)  # the one inside (the other waits at the door)

    first.release.set()
    assert first.result() == (held, False)  # released at exit; never lost inside
    assert held.lost.is_set()  # the term ended with the block
    taken = second.wait_entered()
    assert taken.token > held.token
    second.release.set()
    assert second.result() == (taken, False)
    with lock as again:  # and once more, from this thread
        assert again.token > taken.token


def test_acquire_timeout_names_the_holder(make: Factory, hold: Hold) -> None:
    holder = hold(make.lock(participant_id="worker-a"))
    held = holder.wait_entered()
    waiter = make.lock(timeout=LEASE)
    assert waiter.timeout == LEASE
    with pytest.raises(AcquireTimeout, match=r"held by worker-a \(token 1\)") as info:
        waiter.__enter__()
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, MultilockError)
    holder.release.set()
    assert holder.result() == (held, False)
    with waiter as taken:  # the timed-out object works again
        assert taken.token == 2


def test_loss_sets_lost_and_leaving_raises_leadership_lost(
    make: Factory, store: InMemoryProvider
) -> None:
    link = FaultyProvider(store)
    seen: dict[str, object] = {}

    def body() -> None:
        with make.lock(link, participant_id="cut-off") as held:
            seen["token"] = held.token
            link.inject(Fault.HANG)  # renewals hang: the term ends at its deadline
            assert held.lost.wait(WAIT)  # a thread is not cancelled: it is told
            seen["is_valid"] = held.is_valid
            with pytest.raises(LeadershipLost):
                held.check()
            # The body ends normally: leaving still reports the loss.

    with pytest.raises(LeadershipLost, match=f"group='{NAME}', token=1") as info:
        body()
    assert info.value.token == seen["token"] == 1
    assert seen["is_valid"] is False
    with make.lock(timeout=2 * LEASE) as taken:  # the cut-off lease expires; others get in
        assert taken.token == 2


def test_a_body_error_propagates_and_the_lock_is_released(
    make: Factory, store: InMemoryProvider
) -> None:
    lock = make.lock()
    with pytest.raises(ValueError, match="boom"), lock:
        raise ValueError("boom")
    # Released at once: a waiter gets in long before the lease could have expired.
    with make.lock(timeout=LEASE / 10) as taken:
        assert taken.token == 2

    # An error after a loss wins over LeadershipLost.
    link = FaultyProvider(store)

    def fail_after_the_loss() -> None:
        with make.lock(link) as held:
            link.inject(Fault.HANG)
            assert held.lost.wait(WAIT)
            raise KeyError("after the loss")

    with pytest.raises(KeyError, match="after the loss"):
        fail_after_the_loss()


def test_leaving_from_a_thread_that_does_not_hold_raises(make: Factory, hold: Hold) -> None:
    lock = make.lock()
    with pytest.raises(MultilockError, match="not held by this thread"):
        lock.__exit__(None, None, None)
    holder = hold(lock)
    holder.wait_entered()
    with pytest.raises(MultilockError, match="not held by this thread"):
        lock.__exit__(None, None, None)
    holder.release.set()
    holder.result()


def test_close_releases_the_holders_of_other_threads(
    make: Factory, hold: Hold, background: type[Background]
) -> None:
    lock = make.lock()
    holder = hold(lock)
    held = holder.wait_entered()
    waiter = background(lock.__enter__)  # waits at the door
    still_held(make.lock(timeout=3 * LEASE))  # (well past the waiter's first round)
    lock.close()
    lock.close()  # idempotent
    assert lock.closed
    assert held.lost.is_set()  # told, as at a loss
    with pytest.raises(MultilockError, match="closed"):
        waiter.result()
    holder.release.set()
    with pytest.raises(LeadershipLost, match="closed while held"):
        holder.result()
    with pytest.raises(MultilockError, match="closed"), lock:
        pass
    with make.lock(timeout=LEASE / 10) as taken:  # released, not left to expire
        assert taken.token > held.token


def test_bad_options_raise_at_construction(clock: FakeClock, store: InMemoryProvider) -> None:
    def loop_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("multilock-sync-")}

    before = loop_threads()  # an earlier test's loop thread may still be ending
    with pytest.raises(ConfigurationError, match="group"):
        Lock(store, NAME, loop_factory=clock.new_event_loop, group="x")  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="limit"):
        Semaphore(store, NAME, 0, loop_factory=clock.new_event_loop)
    with pytest.raises(ConfigurationError, match="Provider"):
        Shards(object(), NAME, 2, loop_factory=clock.new_event_loop)  # type: ignore[arg-type]
    assert not loop_threads() - before  # refused before any loop thread was started


# ---------------------------------------------------------------------- Semaphore
def test_semaphore_admits_limit_threads_at_once(make: Factory, hold: Hold) -> None:
    semaphore = make.semaphore(2)
    assert semaphore.limit == 2
    first, second = hold(semaphore), hold(semaphore)
    slots = [first.wait_entered(), second.wait_entered()]
    assert all(isinstance(s, SemaphoreSlot) for s in slots)
    assert sorted(s.slot for s in slots) == [0, 1]
    third = hold(semaphore)
    still_held(make.semaphore(2, timeout=3 * LEASE))
    assert not third.entered.is_set()

    first.release.set()
    first.result()
    freed = slots[0]
    taken = third.wait_entered()
    assert taken.slot == freed.slot  # the freed slot, with a higher token of that slot
    assert taken.token > freed.token
    assert "limit=2" in repr(semaphore)
    for holder in (second, third):
        holder.release.set()
        holder.result()


# ---------------------------------------------------------------------- Shards
def wait_for(shards: Shards, predicate: Callable[[], bool], what: str) -> None:
    """Let virtual time run (one retry at a time) until *predicate* holds."""
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"not within {WAIT} s: {what}"
        shards.wait_changed(timeout=2.0)


def eventually(predicate: Callable[[], bool], what: str) -> None:
    """Wait (real time, bounded) for threads to report. Virtual time does not wait for
    them: a stop gives a thread until the term's deadline, which the fake clock reaches
    in a few milliseconds of real time."""
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"not within {WAIT} s: {what}"
        time.sleep(0.001)


class Recorder:
    """A shard function: record each call, wait for the loss, record that it was seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[int, int, str]] = []
        self.returned: list[tuple[int, int, bool]] = []

    def __call__(self, shard: ShardLeadership) -> None:
        with self.lock:
            self.calls.append((shard.shard, shard.token, threading.current_thread().name))
        seen = shard.lost.wait(WAIT)
        with self.lock:
            self.returned.append((shard.shard, shard.token, seen and not shard.is_valid))

    def shards(self) -> set[int]:
        with self.lock:
            return {shard for shard, _, _ in self.calls}


def test_shards_run_for_each_in_a_thread_per_shard_and_rebalance(
    make: Factory, background: type[Background]
) -> None:
    a, b = make.shards(4, participant_id="a"), make.shards(4, participant_id="b")
    with a, b:
        wait_for(
            a,
            lambda: len(a.owned) == len(b.owned) == 2 and a.share == b.share == 2,
            "two shards each",
        )
        assert a.live_participants == b.live_participants == 2
        assert set(a.owned).isdisjoint(b.owned)
        owned_by_b = dict(b.owned)
        assert all(isinstance(s, ShardLeadership) for s in owned_by_b.values())
        assert (a.count, a.name, a.participant_id) == (4, NAME, "a")

        work_a, work_b = Recorder(), Recorder()
        run_a, run_b = background(a.run_for_each, work_a), background(b.run_for_each, work_b)
        wait_for(a, lambda: work_a.shards() == set(a.owned), "a works on its shards")
        wait_for(b, lambda: work_b.shards() == set(owned_by_b), "b works on its shards")
        names = {name for _, _, name in work_a.calls + work_b.calls}
        assert len(names) == 4  # a thread per shard
        assert all(name.startswith("multilock-leader-") for name in names)

        b.close()  # from another thread: b's run returns once its functions have
        assert run_b.result() is None
        eventually(lambda: len(work_b.returned) == 2, "b's functions return")
        assert sorted(work_b.returned) == sorted((i, s.token, True) for i, s in owned_by_b.items())
        wait_for(a, lambda: len(a.owned) == 4, "a takes over b's shards")
        wait_for(a, lambda: work_a.shards() == {0, 1, 2, 3}, "a works on all four")
        assert a.share == 4
        for index, shard in owned_by_b.items():
            assert a.owned[index].token > shard.token
        assert not run_a.done.is_set()
    assert run_a.result() is None  # leaving the block ended the run
    eventually(lambda: len(work_a.returned) == 4, "a's functions return")
    assert all(seen for _, _, seen in work_a.returned)
    assert a.owned == {}


def test_an_error_in_fn_propagates_and_ends_every_term(make: Factory) -> None:
    shards = make.shards(3)
    others = Recorder()

    def work(shard: ShardLeadership) -> None:
        if shard.shard == 0:
            wait_for_others()
            raise ValueError("shard 0 failed")
        others(shard)

    def wait_for_others() -> None:  # both others run, so both must be told
        eventually(lambda: len(others.shards()) == 2, "the other functions start")

    with shards:
        wait_for(shards, lambda: len(shards.owned) == 3, "all three shards")
        with pytest.raises(ValueError, match="shard 0 failed"):
            shards.run_for_each(work)
        eventually(lambda: len(others.returned) == 2, "the other functions return")
        assert sorted(shard for shard, _, seen in others.returned if seen) == [1, 2]
        assert shards.owned == {}


def test_system_exit_in_fn_reaches_the_caller(make: Factory) -> None:
    shards = make.shards(1)

    def leave(shard: ShardLeadership) -> None:
        raise SystemExit(3)

    with shards:
        wait_for(shards, lambda: len(shards.owned) == 1, "the shard")
        with pytest.raises(SystemExit) as info:
            shards.run_for_each(leave)
    assert info.value.code == 3


def test_run_for_each_refuses_an_async_function(make: Factory) -> None:
    shards = make.shards(1)

    async def work(shard: ShardLeadership) -> None:
        pass

    with shards:
        with pytest.raises(TypeError, match="async function"):
            shards.run_for_each(work)
        with pytest.raises(TypeError, match="not callable"):
            shards.run_for_each(42)  # type: ignore[arg-type]
    with pytest.raises(MultilockError, match="enter the Shards first"):
        shards.run_for_each(print)


# ---------------------------------------------------------------------- providers and loops
def test_url_built_objects_own_and_close_their_provider(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, hold: Hold
) -> None:
    assert "memory" in available_schemes()
    built: list[tuple[InMemoryProvider, threading.Thread]] = []
    closed: list[InMemoryProvider] = []
    original_from_url = InMemoryProvider.from_url.__func__  # type: ignore[attr-defined]
    original_aclose = InMemoryProvider.aclose

    def from_url(cls: type[InMemoryProvider], url: str) -> InMemoryProvider:
        provider: InMemoryProvider = original_from_url(cls, url)
        built.append((provider, threading.current_thread()))
        return provider

    async def aclose(self: InMemoryProvider) -> None:
        closed.append(self)
        await original_aclose(self)

    monkeypatch.setattr(InMemoryProvider, "from_url", classmethod(from_url))
    monkeypatch.setattr(InMemoryProvider, "aclose", aclose)
    url = "memory://sync-holders-test"
    fields: dict[str, Any] = {"loop_factory": clock.new_event_loop, "lease_duration": LEASE}

    lock = Lock(url, NAME, **fields)
    assert built[0][1] is not threading.current_thread()  # built on the loop thread
    assert "memory://sync-holders-test" in repr(lock)
    with lock as held:
        assert closed == []
    assert closed == [built[0][0]]  # the last block out closes it...
    with lock as again:  # ...and the next one builds it again
        assert again.token > held.token
    assert len(built) == len(closed) == 2

    # Two threads in one object: the provider stays open until the last one leaves.
    first = hold(lock)
    first.wait_entered()
    second = hold(lock)
    first.release.set()
    first.result()
    assert len(closed) == 2
    second.wait_entered()
    second.release.set()
    second.result()
    assert len(built) == len(closed) == 3
    lock.close()
    assert len(closed) == 3  # nothing left open to close
    loop_thread = built[0][1]
    assert not loop_thread.is_alive()  # the private loop thread ended with the last user

    # Shards: the block is its life; leaving closes it for good.
    shards = Shards(url, NAME, 2, **fields)
    with shards:
        wait_for(shards, lambda: len(shards.owned) == 2, "both shards")
    assert shards.closed
    assert closed[-1] is built[-1][0]
    assert len(closed) == 4
    with pytest.raises(MultilockError, match="closed"), shards:
        pass

    # Options refused once the provider was built: the provider is closed again.
    with pytest.raises(ConfigurationError):
        Semaphore(url, NAME, 2, loop_factory=clock.new_event_loop, renew_interval=LEASE)
    assert len(closed) == 5


def test_blocking_calls_from_the_loop_thread_raise(
    store: InMemoryProvider, loop_thread: LoopThread
) -> None:
    factory = loop_thread.factory
    lock = Lock(store, NAME, loop_factory=factory)
    shards = Shards(store, "pool", 2, loop_factory=factory)
    try:
        shards.__enter__()
        wait_for(shards, lambda: len(shards.owned) == 2, "both shards")
        calls: dict[str, Callable[[], object]] = {
            "Lock": lambda: Lock(store, NAME, loop_factory=factory),
            "Semaphore": lambda: Semaphore(store, NAME, 2, loop_factory=factory),
            "Shards": lambda: Shards(store, NAME, 2, loop_factory=factory),
            "enter": lock.__enter__,
            "exit": lambda: lock.__exit__(None, None, None),
            "close": lock.close,
            "enter shards": shards.__enter__,
            "exit shards": lambda: shards.__exit__(None, None, None),
            "run_for_each": lambda: shards.run_for_each(print),
            "wait_changed": shards.wait_changed,
            "close shards": shards.close,
        }
        loop_thread.assert_deadlocks_refused(calls)
        assert loop_thread.run(lambda: sorted(shards.owned)) == [0, 1]  # local: never blocks
        assert not lock.closed
        assert not shards.closed
        with lock as held:  # nothing was broken
            assert held.is_valid
    finally:
        shards.close()
        lock.close()


def interrupt_main_thread(
    event: threading.Event, clock: FakeClock, seconds: float, background: type[Background]
) -> Background:
    """Send a real SIGINT to this (main) thread *seconds* of virtual time after *event* is
    set: Ctrl-C, as a user would, while the main thread waits."""
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    main = threading.get_ident()

    def send() -> None:
        assert event.wait(WAIT)
        until = clock.now + seconds
        deadline = time.monotonic() + WAIT
        while clock.now < until:  # virtual time runs while the main thread waits
            assert time.monotonic() < deadline, "virtual time did not run"
            time.sleep(0.001)
        signal.pthread_kill(main, signal.SIGINT)

    return background(send)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_ctrl_c_while_waiting_leaves_nothing_behind(
    make: Factory, clock: FakeClock, hold: Hold, background: type[Background]
) -> None:
    lock = make.lock()
    holder = hold(lock)
    held = holder.wait_entered()
    waiting = threading.Event()
    sender = interrupt_main_thread(waiting, clock, 3 * LEASE, background)

    def wait_at_the_door() -> None:
        waiting.set()
        with lock:
            pytest.fail("acquired what another thread holds")

    with pytest.raises(KeyboardInterrupt):
        wait_at_the_door()
    sender.result()
    holder.release.set()
    holder.result()
    # The interrupted waiter stopped campaigning: a newcomer gets the lock at once.
    with make.lock(timeout=LEASE / 10) as taken:
        assert taken.token == held.token + 1
    assert "held=0" in repr(lock)
