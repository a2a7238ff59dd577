"""Leader work of the wrong colour is refused when it is passed, not when a term begins.

The async API awaits ``fn(leadership)``: a plain function would fail only when this
replica first wins (during a failover, in production). The sync facade calls it in a
thread: an async function would only make a coroutine that never runs.
"""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import pytest

from multilock.core import InMemoryProvider, LeaderElection, Leadership, RunStatus
from multilock.core import sync as sync_module
from multilock.core.testing import FakeClock


def plain_report(leadership: Leadership) -> None:
    pass


async def async_report(leadership: Leadership, value: int = 1) -> int:
    return value


class AsyncCallable:
    async def __call__(self, leadership: Leadership) -> int:
        return 2

    async def method(self, leadership: Leadership) -> int:
        return 3


class PlainCallable:
    def __call__(self, leadership: Leadership) -> None:
        pass


@pytest.mark.parametrize(
    ("fn", "name"),
    [
        (plain_report, "plain_report"),
        (functools.partial(plain_report), "functools.partial"),
        (PlainCallable(), "PlainCallable"),
        (lambda leadership: None, "<lambda>"),
        (print, "print"),
        (42, "42"),
    ],
)
async def test_the_async_api_refuses_a_plain_function_at_once(fn: Any, name: str) -> None:
    election = LeaderElection(InMemoryProvider(), group="g")  # not even started
    for method in (election.run_while_leader, election.run_if_leader):
        with pytest.raises(TypeError) as info:
            await method(fn)
        text = str(info.value)
        assert name in text
        assert f"{method.__name__}() needs an async function" in text
        assert "multilock.core.sync.LeaderElection" in text


def test_the_async_api_accepts_every_kind_of_async_callable() -> None:
    clock = FakeClock()
    accepted = {
        "async def": (async_report, 1),
        "partial": (functools.partial(async_report, value=5), 5),
        "async __call__": (AsyncCallable(), 2),
        "bound async method": (AsyncCallable().method, 3),
        "AsyncMock": (mock.AsyncMock(return_value=4), 4),
    }

    async def main() -> None:
        store = InMemoryProvider(clock=clock.monotonic)
        async with LeaderElection(store, group="g") as election:
            await election.wait_until_leader(timeout=5)
            for kind, (fn, value) in accepted.items():
                result = await election.run_if_leader(fn)
                assert (result.status, result.value) == (RunStatus.COMPLETED, value), kind

    clock.run(main)


@pytest.mark.parametrize(
    "fn",
    [async_report, functools.partial(async_report, value=2), AsyncCallable()],
)
def test_the_sync_facade_refuses_an_async_function_at_once(fn: Any) -> None:
    clock = FakeClock(real_grace=0.001)
    election = sync_module.LeaderElection(
        InMemoryProvider(clock=clock.monotonic), group="g", loop_factory=clock.new_event_loop
    )
    try:
        for method in (election.run_while_leader, election.run_if_leader):
            with pytest.raises(TypeError) as info:  # not MultilockError("start it first")
                method(fn)
            text = str(info.value)
            assert "is an async function" in text
            assert "never runs" in text
            assert f"await multilock.core.LeaderElection(...).{method.__name__}(fn)" in text
        election.start()
        election.wait_until_leader(timeout=5)
        with pytest.raises(TypeError, match="is an async function"):
            election.run_if_leader(fn)  # used to return a never-awaited coroutine as its value
        assert election.run_if_leader(lambda leadership: 7).value == 7
    finally:
        election.close()
