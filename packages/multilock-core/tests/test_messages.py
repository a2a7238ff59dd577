"""Each bad input and each timeout gets a specific message, and no secret travels on."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from multilock.core import (
    MIN_LEASE_DURATION,
    ConfigurationError,
    ElectionOptions,
    InMemoryProvider,
    LeaderElection,
    from_url,
    validate_name,
)
from multilock.core import _url as url_module
from multilock.core import sync as sync_module
from multilock.core.provider import call_until
from multilock.core.testing import FakeClock, Fault, FaultyProvider

SECRET = "hunter2-s3cret"


# ---------------------------------------------------------------------- timeouts
def test_the_async_wait_says_what_timed_out_after_how_long_and_why() -> None:
    clock = FakeClock()

    async def main() -> None:
        store = InMemoryProvider(clock=clock.monotonic)
        async with (
            LeaderElection(store, group="g", participant_id="a") as a,
            LeaderElection(store, group="g", participant_id="b") as b,
        ):
            held = await a.wait_until_leader(timeout=5)
            with pytest.raises(TimeoutError) as info:
                await b.wait_until_leader(timeout=2.5)
            assert str(info.value) == (
                "wait_until_leader: g/b did not become leader within 2.5 s "
                f"(a leads with token {held.token})"
            )

        faulty = FaultyProvider(store)
        faulty.inject(Fault.RAISE, "try_acquire", "get_leader")
        async with LeaderElection(faulty, group="h", participant_id="c") as c:
            with pytest.raises(TimeoutError) as info:
                await c.wait_until_leader(timeout=3)
            assert "its last campaign round failed: injected failure" in str(info.value)

    clock.run(main)


def test_the_sync_wait_says_what_timed_out_and_after_how_long() -> None:
    clock = FakeClock(real_grace=0.001)
    store = InMemoryProvider(clock=clock.monotonic)
    elections = [
        sync_module.LeaderElection(
            store, group="g", participant_id=name, loop_factory=clock.new_event_loop
        )
        for name in ("a", "b")
    ]
    a, b = elections
    try:
        a.start()
        a.wait_until_leader(timeout=5)
        b.start()
        with pytest.raises(TimeoutError) as info:
            b.wait_until_leader(timeout=1.5)
        assert "wait_until_leader: g/b did not become leader within 1.5 s" in str(info.value)
        assert "a leads with token" in str(info.value)
    finally:
        for election in elections:
            election.close()


def test_a_provider_call_past_its_deadline_is_named_with_its_budget() -> None:
    clock = FakeClock()

    async def main() -> None:
        faulty = FaultyProvider(InMemoryProvider(clock=clock.monotonic))
        faulty.inject(Fault.HANG, "get_leader")
        deadline = asyncio.get_running_loop().time() + 4
        with pytest.raises(TimeoutError) as info:
            await call_until(faulty.get_leader("g"), deadline)
        assert str(info.value) == "FaultyProvider.get_leader did not finish within 4 s"

        async def own_timeout() -> None:
            raise TimeoutError("the driver's own")

        with pytest.raises(TimeoutError, match="the driver's own"):  # passed on untouched
            await call_until(own_timeout(), deadline + 10)

    clock.run(main)


# ---------------------------------------------------------------------- the lease's floor
@pytest.mark.parametrize("lease", [0.001, 0.05, timedelta(milliseconds=99)])
def test_a_lease_below_the_floor_is_refused_saying_why(lease: Any) -> None:
    with pytest.raises(ConfigurationError) as info:
        ElectionOptions(lease_duration=lease)
    text = str(info.value)
    assert "is too short: the minimum is 0.1 s" in text
    assert "renews every third of the lease" in text
    with pytest.raises(ConfigurationError, match="too short"):
        LeaderElection(InMemoryProvider(), lease_duration=lease)


def test_the_floor_itself_is_accepted() -> None:
    assert MIN_LEASE_DURATION == 0.1
    assert ElectionOptions(lease_duration=0.1).lease_duration == 0.1
    assert ElectionOptions(lease_duration=timedelta(milliseconds=100)).lease_duration == 0.1


# ---------------------------------------------------------------------- names and URLs
@pytest.mark.parametrize("field", ["participant_id", "group"])
def test_a_long_name_says_its_length_and_the_limit(field: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        validate_name("p" * 300, field)
    assert "it has 300 characters (the limit is 255)" in str(info.value)
    with pytest.raises(ConfigurationError, match="it has 300 characters"):
        ElectionOptions(**{field: "p" * 300})


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "it is empty"),
        ("a b", "' ' is not allowed"),
        ("a/b:c", "'/', ':' are not allowed"),
    ],
)
def test_an_invalid_name_says_what_is_wrong(name: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match=f"group {name!r} is invalid: {why}; use 1 to"):
        validate_name(name)


@pytest.fixture
def schemes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend redis and file providers are installed (they are never loaded here)."""
    installed = {**url_module._BUILTIN, "redis": "unused:Redis", "file": "unused:File"}
    monkeypatch.setattr(url_module, "_entry_points", lambda: dict(installed))


@pytest.mark.usefixtures("schemes")
@pytest.mark.parametrize(
    ("url", "example"),
    [
        ("localhost:6379", "redis://localhost:6379"),
        ("127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        (f"user:{SECRET}@cache:6379", "redis://user:***@cache:6379"),
        ("/var/lock/app", "file:///var/lock/app"),
    ],
)
def test_a_url_without_a_scheme_shows_the_form_to_use(url: str, example: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        from_url(url)
    text = str(info.value)
    assert "has no scheme: write it as scheme://host:port/..." in text
    assert f"for example {example};" in text
    assert text.endswith("installed schemes: file, memory, redis")
    assert SECRET not in text


def test_a_provider_error_holding_the_password_does_not_travel_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Picky:
        @classmethod
        def from_url(cls, url: str, **kwargs: Any) -> Any:
            raise ConfigurationError(f"cannot use {url}: no such directory")

    monkeypatch.setattr(url_module, "_entry_points", lambda: {"picky": "unused:Picky"})
    monkeypatch.setattr(url_module, "_load", lambda target: Picky)
    with pytest.raises(ConfigurationError) as info:
        from_url(f"picky://u:{SECRET}@host/dir")
    assert "picky://u:***@host/dir" in str(info.value)
    assert info.value.__cause__ is None
    assert info.value.__context__ is None  # the provider's own error held the password
