"""Fixtures shared by the tests of the core: virtual time, a store on it, blocking calls in
threads (for the sync facades) and a broken store (for the simulators).

Test modules cannot import this one (``--import-mode=importlib``): helpers reach them as
fixtures, and their types through ``if TYPE_CHECKING: from conftest import ...``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from multilock.core import InMemoryProvider, LeaderInfo
from multilock.core.testing import FakeClock, StoreFactory

#: Real seconds a thread may take to report back; a bound, never a sleep.
WAIT = 5.0


@pytest.fixture
def clock() -> FakeClock:
    """Virtual time for one test: the loop threads made with it share one event loop."""
    return FakeClock(real_grace=0.001)


@pytest.fixture
def store(clock: FakeClock) -> InMemoryProvider:
    """A store that judges expiry on the test's virtual clock."""
    return InMemoryProvider(clock=clock.monotonic)


# ---------------------------------------------------------------------- threads
class Background:
    """Run a blocking call in a daemon thread and keep its outcome."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(fn, *args), daemon=True)
        self.thread.start()

    def _main(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.value = fn(*args)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def result(self) -> Any:
        assert self.done.wait(WAIT), "the background call did not return in time"
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture
def background() -> type[Background]:
    """``background(fn, *args)`` calls ``fn(*args)`` in a daemon thread (`Background`)."""
    return Background


class LoopThread:
    """Sync objects made with `factory` share one loop thread on the test's clock; `run`
    calls a function in that thread, as provider code or a callback running there would."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self._loops: list[asyncio.AbstractEventLoop] = []

    def factory(self) -> asyncio.AbstractEventLoop:
        loop = self._clock.new_event_loop()
        self._loops.append(loop)
        return loop

    def run(self, fn: Callable[[], Any]) -> Any:
        """Call *fn* in the loop thread; return its value (or raise its exception)."""
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                outcome["value"] = fn()
            except BaseException as exc:
                outcome["error"] = exc
            finally:
                done.set()

        self._loops[0].call_soon_threadsafe(call)
        assert done.wait(WAIT), "the loop thread did not run the call"
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def assert_deadlocks_refused(self, calls: Mapping[str, Callable[[], object]]) -> None:
        """Every blocking call of *calls*, made in the loop thread, raises `RuntimeError`
        (a deadlock refused) instead of blocking."""

        def probe() -> dict[str, BaseException | None]:
            errors: dict[str, BaseException | None] = {}
            for name, call in calls.items():
                try:
                    call()
                except BaseException as exc:
                    errors[name] = exc
                else:
                    errors[name] = None
            return errors

        errors = self.run(probe)
        assert list(errors) == list(calls)
        for name, error in errors.items():
            assert isinstance(error, RuntimeError), name
            assert "deadlock" in str(error), name


@pytest.fixture
def loop_thread(clock: FakeClock) -> LoopThread:
    """One private loop thread on the test's clock, and calls made from inside it."""
    return LoopThread(clock)


# ---------------------------------------------------------------------- simulators
class Forgetful(InMemoryProvider):
    """A broken store: it never reports a leader, and try_acquire lets anyone in."""

    async def get_leader(self, group: str) -> LeaderInfo | None:
        return None

    async def try_acquire(
        self, group: str, participant_id: str, lease_duration: float, metadata: Mapping[str, str]
    ) -> LeaderInfo | None:
        holder = await super().get_leader(group)
        if holder is not None:  # takes the lease from a live holder: two leaders
            await self.release(group, holder.participant_id, holder.token)
        return await super().try_acquire(group, participant_id, lease_duration, metadata)


def _forgetful(clock: Callable[[], float]) -> Forgetful:
    return Forgetful(clock=clock)


@pytest.fixture
def forgetful() -> StoreFactory:
    """A store factory for the simulators that builds a `Forgetful` store."""
    return _forgetful
