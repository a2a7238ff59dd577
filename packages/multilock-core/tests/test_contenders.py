"""`contenders` and `Provider.contenders`: a clear refusal where the store cannot list the
candidates, a checked group, a bounded wait, and the contract check that can fail."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta

import pytest

from multilock.core import (
    ConfigurationError,
    FailureReason,
    InMemoryProvider,
    MultilockError,
    ProviderError,
    UnsupportedOperation,
    contenders,
)
from multilock.core.testing import FakeClock, check_provider


class Queue(InMemoryProvider):
    """An in-memory store that also keeps a line of candidates, as ZooKeeper does."""

    def __init__(self, line: Sequence[str] = ()) -> None:
        super().__init__()
        self.line = line
        self.asked: list[str] = []

    async def contenders(self, group: str) -> Sequence[str]:
        self.asked.append(group)
        return self.line


class Hangs(InMemoryProvider):
    """A store that never answers ``contenders``; records whether the call was cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = asyncio.Event()

    async def contenders(self, group: str) -> Sequence[str]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


class Fails(InMemoryProvider):
    async def contenders(self, group: str) -> Sequence[str]:
        raise ProviderError("the store broke")


async def test_a_store_that_records_only_the_leader_says_so_clearly() -> None:
    provider = InMemoryProvider()
    with pytest.raises(UnsupportedOperation) as caught:
        await contenders(provider, "reports")
    message = str(caught.value)
    assert message.startswith("InMemoryProvider cannot list the contenders of group 'reports'")
    assert "records only the leader" in message
    assert "ZooKeeper" in message
    # One tree, and the standard meaning: callers can catch either.
    assert isinstance(caught.value, MultilockError)
    assert isinstance(caught.value, NotImplementedError)
    assert not isinstance(caught.value, ProviderError)


async def test_the_refusal_names_the_subclass_that_refuses() -> None:
    class RedisLike(InMemoryProvider):
        pass

    with pytest.raises(UnsupportedOperation, match=r"^RedisLike cannot list"):
        await RedisLike().contenders("g")


@pytest.mark.parametrize("bad", ["", "has space", "slash/name", "x" * 256, 7])
async def test_the_group_is_checked_before_anything_else(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="group"):
        await InMemoryProvider().contenders(bad)  # type: ignore[arg-type]  # the default
    provider = Queue(["a"])
    with pytest.raises(ConfigurationError, match="group"):
        await contenders(provider, bad)  # type: ignore[arg-type]  # an override, wrapped
    assert provider.asked == []


async def test_an_override_answers_as_a_tuple_in_its_order() -> None:
    provider = Queue(["leader", "next", "last"])
    assert await contenders(provider, "g") == ("leader", "next", "last")
    assert await contenders(Queue([]), "g") == ()
    assert provider.asked == ["g"]


@pytest.mark.parametrize("bad", [0, -1, float("inf"), "10", True])
async def test_an_invalid_timeout_is_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="timeout"):
        await contenders(Queue(), "g", timeout=bad)  # type: ignore[arg-type]


async def test_a_store_failure_passes_through() -> None:
    with pytest.raises(ProviderError, match="the store broke"):
        await contenders(Fails(), "g")


@pytest.mark.parametrize(
    ("timeout", "seconds"), [(None, 10.0), (2.5, 2.5), (timedelta(seconds=3), 3.0)]
)
def test_a_hanging_store_gives_a_provider_error_at_the_timeout(
    timeout: float | timedelta | None, seconds: float
) -> None:
    clock = FakeClock()
    provider = Hangs()

    async def main() -> float:
        started = asyncio.get_running_loop().time()
        asking = contenders(provider, "g", **({} if timeout is None else {"timeout": timeout}))
        with pytest.raises(ProviderError) as caught:
            await asking
        waited = asyncio.get_running_loop().time() - started
        assert str(caught.value) == f"contenders('g') did not answer within {seconds:g} s"
        assert caught.value.reason is FailureReason.TIMEOUT
        assert caught.value.__cause__ is None
        assert caught.value.__context__ is None
        await asyncio.wait_for(provider.cancelled.wait(), 1)  # the hung call is cancelled
        return waited

    assert clock.run(main()) == pytest.approx(seconds)


def test_the_contract_accepts_a_refusal_and_a_leader_first_line() -> None:
    class LeaderOnly(InMemoryProvider):
        async def contenders(self, group: str) -> Sequence[str]:
            leader = await self.get_leader(group)
            return () if leader is None else (leader.participant_id,)

    for provider in (InMemoryProvider, LeaderOnly):
        name = f"contenders-ok-{provider.__name__}"
        asyncio.run(
            check_provider(
                lambda p=provider, n=name: p(store_name=n),  # type: ignore[misc]
                only="contenders_start_with_the_leader",
            )
        )


@pytest.mark.parametrize("wrong", ["follower first", "a string", "no leader"])
def test_the_contract_catches_a_wrong_line(wrong: str) -> None:
    """The check can fail: a line not led by the leader, or not a sequence of names."""

    class Wrong(InMemoryProvider):
        async def contenders(self, group: str) -> Sequence[str]:
            leader = await self.get_leader(group)
            if leader is None:
                return ()
            if wrong == "follower first":
                return ("p2", leader.participant_id)
            if wrong == "a string":
                return leader.participant_id
            return ()

    with pytest.raises(AssertionError, match="contenders_start_with_the_leader"):
        asyncio.run(
            check_provider(
                lambda: Wrong(store_name=f"contenders-wrong-{wrong.replace(' ', '-')}"),
                only="contenders_start_with_the_leader",
            )
        )


def test_the_sync_election_asks_the_same_question():
    from multilock.core import UnsupportedOperation
    from multilock.core.sync import LeaderElection as SyncElection

    with (
        SyncElection("memory://sync-contenders", group="g") as election,
        pytest.raises(UnsupportedOperation, match="InMemoryProvider cannot list"),
    ):
        election.contenders()
