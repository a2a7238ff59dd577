"""`probe` and the ``probe_timeout`` option: a bad store fails fast, saying which mistake.

The cheap real cases (a closed loopback port, a name under ``.invalid``) go through the
real Redis provider; the rest are synthetic exception chains shaped like the drivers'.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import socket
import ssl
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest

from multilock.core import (
    ConfigurationError,
    ElectionOptions,
    ElectionState,
    FailureReason,
    InMemoryProvider,
    LeaderElection,
    LeaderInfo,
    ProviderError,
    probe,
)
from multilock.core import sync as sync_module
from multilock.core.provider import DriverCalls, Provider
from multilock.core.testing import FakeClock, Fault, FaultyProvider

SECRET = "hunter2-s3cret"


def links(exc: BaseException) -> Iterator[BaseException]:
    """*exc* and everything reachable from it through __cause__ and __context__."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]


def assert_secret_free(exc: BaseException) -> None:
    for each in links(exc):
        assert SECRET not in f"{each} {each!r} {each.args!r}", each


class Broken(Provider):
    """A store whose every call raises what the test built."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def try_acquire(self, group, participant_id, lease_duration, metadata):  # type: ignore[no-untyped-def]
        raise self.error

    async def renew(self, group, participant_id, token, lease_duration, metadata):  # type: ignore[no-untyped-def]
        raise self.error

    async def release(self, group, participant_id, token):  # type: ignore[no-untyped-def]
        raise self.error

    async def get_leader(self, group):  # type: ignore[no-untyped-def]
        raise self.error


def chained(*errors: BaseException) -> BaseException:
    """``errors[0]`` raised from ``errors[1]`` raised from ... (outermost first)."""
    for outer, inner in itertools.pairwise(errors):
        outer.__cause__ = inner
    return errors[0]


async def probe_failure(error: BaseException) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        await probe(Broken(error), "g", timeout=5)
    assert_secret_free(info.value)
    assert info.value.__cause__ is None
    assert info.value.__context__ is None
    return info.value


# ---------------------------------------------------------------------- real sockets
@pytest.fixture
def closed_port() -> int:
    with socket.socket() as server:  # bound, never listening: connecting is refused
        server.bind(("127.0.0.1", 0))
        port: int = server.getsockname()[1]
    return port


async def test_a_closed_port_is_reported_as_refused_with_host_and_port(closed_port: int) -> None:
    redis = pytest.importorskip("multilock.redis")
    provider = redis.RedisProvider.from_url(f"redis://user:{SECRET}@127.0.0.1:{closed_port}/0")
    try:
        with pytest.raises(ProviderError) as info:
            await probe(provider, "g", timeout=10)
    finally:
        await provider.aclose()
    error = info.value
    assert error.reason is FailureReason.CONNECTION_REFUSED
    assert str(error).startswith(
        f"cannot reach the store: the connection to 127.0.0.1:{closed_port} was refused"
    ), error
    assert error.__cause__ is None
    assert error.__context__ is None
    assert_secret_free(error)


async def test_a_host_name_that_does_not_resolve_is_named() -> None:
    redis = pytest.importorskip("multilock.redis")
    provider = redis.RedisProvider.from_url(f"redis://:{SECRET}@no-such-host.invalid:6379/0")
    try:
        with pytest.raises(ProviderError) as info:
            await probe(provider, "g", timeout=30)
    finally:
        await provider.aclose()
    error = info.value
    assert error.reason is FailureReason.NAME_NOT_RESOLVED
    assert "the host name 'no-such-host.invalid' does not resolve" in str(error), error
    assert_secret_free(error)


# ---------------------------------------------------------------------- synthetic chains
class AuthenticationError(Exception):  # redis-py's name (a ConnectionError subclass there)
    pass


class OperationalError(Exception):  # psycopg's and pyodbc's
    pass


class AuthFailedError(Exception):  # kazoo's
    pass


class UnauthenticatedError(Exception):  # aetcd's
    pass


class ClientAuthenticationError(Exception):  # azure-core's
    pass


class ACLPermissionDenied(Exception):  # py-consul's
    pass


class S3Error(Exception):  # minio's: the code is in the message
    pass


class HTTPError(Exception):
    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


class ConnectTimeoutError(Exception):  # urllib3's: NewConnectionError derives from it
    pass


class NewConnectionError(ConnectTimeoutError):
    pass


def context_chain() -> BaseException:
    """requests' way: the driver error raised while handling the OS error (__context__)."""
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError:
            raise OSError("Max retries exceeded with url: /v1/kv/x") from None
    except OSError as exc:
        exc.__suppress_context__ = False
        return exc


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ProviderError("redis call failed", reason=None), FailureReason.OTHER),
        (
            chained(ProviderError("redis get_leader failed"), AuthenticationError("WRONGPASS x")),
            FailureReason.AUTHENTICATION,
        ),
        (ProviderError("NOAUTH Authentication required."), FailureReason.AUTHENTICATION),
        (
            OperationalError('FATAL:  password authentication failed for user "app"'),
            FailureReason.AUTHENTICATION,
        ),
        (
            OperationalError("[28000] Login failed for user 'sa'. (18456)"),
            FailureReason.AUTHENTICATION,
        ),
        (AuthFailedError(), FailureReason.AUTHENTICATION),
        (UnauthenticatedError("invalid auth token"), FailureReason.AUTHENTICATION),
        (ClientAuthenticationError("Server failed to authenticate"), FailureReason.AUTHENTICATION),
        (ACLPermissionDenied("ACL not found"), FailureReason.AUTHENTICATION),
        (S3Error("S3 operation failed; code: InvalidAccessKeyId"), FailureReason.AUTHENTICATION),
        (S3Error("code: SignatureDoesNotMatch"), FailureReason.AUTHENTICATION),
        (HTTPError(401), FailureReason.AUTHENTICATION),
        (
            chained(ProviderError("x"), ssl.SSLCertVerificationError(1, "certificate verify")),
            FailureReason.TLS,
        ),
        (OperationalError("SSL error: wrong version number"), FailureReason.TLS),
        (
            chained(ProviderError("x"), OSError("connect"), socket.gaierror(-2, "Name")),
            FailureReason.NAME_NOT_RESOLVED,
        ),
        (
            OperationalError('could not translate host name "db.example" to address'),
            FailureReason.NAME_NOT_RESOLVED,
        ),
        (
            chained(NewConnectionError("new connection"), ConnectionRefusedError(111, "no")),
            FailureReason.CONNECTION_REFUSED,  # not TIMEOUT: its base class is misleading
        ),
        (context_chain(), FailureReason.CONNECTION_REFUSED),
        (ProviderError("x: [Errno 111] Connection refused"), FailureReason.CONNECTION_REFUSED),
        (chained(ProviderError("x"), TimeoutError()), FailureReason.TIMEOUT),
        (ConnectTimeoutError("connect"), FailureReason.TIMEOUT),
        (OperationalError("HYT00 Login timeout expired"), FailureReason.TIMEOUT),
        (
            # The credentials were refused, then the connection closed: the cause wins.
            chained(ProviderError("x"), ConnectionResetError(), AuthenticationError("bad")),
            FailureReason.AUTHENTICATION,
        ),
        (chained(ProviderError("x"), KeyError("k")), FailureReason.OTHER),
    ],
)
def test_the_reason_is_read_from_the_whole_chain(
    error: BaseException, reason: FailureReason
) -> None:
    wrapped = ProviderError("store call failed")
    wrapped.__cause__ = error
    assert wrapped.reason is reason
    assert asyncio.run(probe_failure(error)).reason is reason


def test_a_given_reason_wins_and_survives_pickling() -> None:
    error = ProviderError("x", reason=FailureReason.TLS)
    error.__cause__ = ConnectionRefusedError()
    assert error.reason is FailureReason.TLS
    assert pickle.loads(pickle.dumps(error)).reason is FailureReason.TLS
    assert FailureReason.TLS == "tls"  # a str enum: logs and JSON read it as is


async def test_each_reason_has_its_own_message() -> None:
    refused = await probe_failure(
        chained(OSError("connecting to db.example:5432"), ConnectionRefusedError(111, "no"))
    )
    assert str(refused).startswith(
        "cannot reach the store: the connection to db.example:5432 was refused"
    )
    auth = await probe_failure(AuthenticationError("invalid username-password pair"))
    assert str(auth).startswith("the store refused the credentials (authentication failed)")
    assert str(auth).endswith(": invalid username-password pair")
    tls = await probe_failure(ssl.SSLError(1, "[SSL: CERTIFICATE_VERIFY_FAILED]"))
    assert str(tls).startswith("the TLS handshake with the store failed")
    other = await probe_failure(chained(ProviderError("redis call failed"), KeyError("k")))
    assert other.reason is FailureReason.OTHER
    assert str(other).startswith("the store call failed with KeyError: redis call failed")
    driver = await probe_failure(chained(ProviderError("x"), S3Error("NoSuchBucket")))
    assert f"failed with {__name__}.S3Error" in str(driver)


async def test_no_secret_in_the_message_or_the_chain() -> None:
    driver = OSError(
        f"connect to redis://u:{SECRET}@h:1/0 failed (dsn: host=h password={SECRET} port=1)"
    )
    error = await probe_failure(chained(ProviderError("redis get_leader failed"), driver))
    assert "redis://u:***@h:1/0" in str(error)
    assert "password=***" in str(error)


def test_an_unanswered_probe_times_out_with_its_timeout_in_the_message() -> None:
    clock = FakeClock()

    async def main() -> None:
        faulty = FaultyProvider(InMemoryProvider(clock=clock.monotonic))
        faulty.inject(Fault.HANG, "get_leader")
        start = clock.now
        with pytest.raises(ProviderError) as info:
            await probe(faulty, "g", timeout=timedelta(seconds=7.5))
        assert clock.now - start == pytest.approx(7.5)
        assert info.value.reason is FailureReason.TIMEOUT
        assert str(info.value).startswith("the store did not answer within 7.5 s")
        assert info.value.__context__ is None

    clock.run(main)


class SlowToCancel(FaultyProvider):
    """A store whose ``get_leader`` hangs, then takes *settle* seconds to honour a cancel
    (psycopg cancelling the query on the server, a worker thread at its socket timeout)."""

    def __init__(self, inner: Provider, settle: float = 300.0) -> None:
        super().__init__(inner)
        self.settle = settle
        self.settled = 0

    async def get_leader(self, group: str) -> LeaderInfo | None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.sleep(self.settle))
            self.settled += 1
            raise
        raise AssertionError("unreachable")


def test_a_driver_slow_to_cancel_does_not_hold_the_probe_past_its_timeout() -> None:
    clock = FakeClock()

    async def main() -> None:
        slow = SlowToCancel(InMemoryProvider(clock=clock.monotonic), settle=300)
        start = clock.now
        with pytest.raises(ProviderError) as info:
            await probe(slow, "g", timeout=3)
        assert clock.now - start == pytest.approx(3), "the probe waited for the driver"
        assert info.value.reason is FailureReason.TIMEOUT
        assert str(info.value).startswith("the store did not answer within 3 s"), info.value
        assert info.value.__context__ is None
        assert slow.settled == 0  # given up on, still settling

        election = LeaderElection(slow, group="g", probe_timeout=timedelta(seconds=2))
        start = clock.now
        with pytest.raises(ProviderError, match="did not answer within 2 s"):
            await election.start()
        assert clock.now - start == pytest.approx(2)
        assert election.state is ElectionState.IDLE

        await asyncio.sleep(slow.settle + 1)  # the abandoned calls settle in the background
        assert slow.settled == 2

    clock.run(main)


async def test_a_timeout_of_the_drivers_own_is_not_reported_as_the_probes() -> None:
    error = await probe_failure(TimeoutError("read timed out"))
    assert error.reason is FailureReason.TIMEOUT
    assert str(error).startswith("the store did not answer in time"), error
    assert str(error).endswith(": read timed out"), error


async def test_probe_returns_the_leader_without_the_private_nonce() -> None:
    store = InMemoryProvider()
    assert await probe(store, "g") is None
    async with LeaderElection(store, group="g", participant_id="p", metadata={"k": "v"}) as e:
        held = await e.wait_until_leader(timeout=5)
        info = await probe(store, "g")
    assert isinstance(info, LeaderInfo)
    assert (info.participant_id, info.token, info.metadata) == ("p", held.token, {"k": "v"})
    with pytest.raises(ConfigurationError, match="group 'a b' is invalid"):
        await probe(store, "a b")
    with pytest.raises(ConfigurationError, match="timeout must be"):
        await probe(store, "g", timeout=0)


def test_driver_calls_keep_the_reason_of_a_chain_they_drop_for_its_secret() -> None:
    calls = DriverCalls("redis", "h:1", timeout=1, secrets=[SECRET])

    async def refuse() -> None:
        raise ConnectionRefusedError(111, f"refused, password {SECRET}")

    async def main() -> ProviderError:
        with pytest.raises(ProviderError) as info:
            await calls.call("get_leader", refuse())
        return info.value

    error = asyncio.run(main())
    assert error.__cause__ is None  # it held the secret
    assert error.__context__ is None
    assert_secret_free(error)
    assert error.reason is FailureReason.CONNECTION_REFUSED


# ---------------------------------------------------------------------- probe_timeout
def test_probe_timeout_is_a_duration_or_none() -> None:
    assert ElectionOptions().probe_timeout is None
    assert ElectionOptions(probe_timeout=timedelta(seconds=4)).probe_timeout == 4.0
    with pytest.raises(ConfigurationError, match="probe_timeout must be a positive"):
        ElectionOptions(probe_timeout=0)


def test_start_with_probe_timeout_raises_instead_of_campaigning() -> None:
    clock = FakeClock()

    async def main() -> None:
        store = InMemoryProvider(clock=clock.monotonic)
        faulty = FaultyProvider(store)
        refused = ProviderError("redis get_leader failed")
        refused.__cause__ = ConnectionRefusedError(111, "Connect call failed ('10.0.0.1', 6379)")

        async def get_leader(group: str) -> None:
            raise refused

        faulty.get_leader = get_leader  # type: ignore[method-assign]
        election = LeaderElection(faulty, group="g", probe_timeout=3)
        refused_at = r"connection to 10\.0\.0\.1:6379 was refused"
        with pytest.raises(ProviderError, match=refused_at) as info:
            await election.start()
        assert info.value.reason is FailureReason.CONNECTION_REFUSED
        assert election.state is ElectionState.IDLE  # nothing was started
        assert faulty.calls["try_acquire"] == 0

        hung = FaultyProvider(store)
        hung.inject(Fault.HANG, "get_leader")
        election = LeaderElection(hung, group="g", probe_timeout=3)
        start = clock.now
        with pytest.raises(ProviderError, match=r"did not answer within 3 s") as info:
            await election.start()
        assert clock.now - start == pytest.approx(3)
        assert info.value.reason is FailureReason.TIMEOUT

        # Without the option, the same store is campaigned against (and warned about).
        election = LeaderElection(hung, group="g")
        await election.start()
        assert election.state is ElectionState.CAMPAIGNING
        await election.stop()

        # A healthy store: the probe passes, the election leads, and starting again (already
        # running) does not probe again.
        election = LeaderElection(store, group="g", probe_timeout=3)
        await election.start()
        await election.wait_until_leader(timeout=5)
        await election.start()
        await election.stop()

    clock.run(main)


def test_the_sync_facade_closes_a_url_provider_whose_probe_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock(real_grace=0.001)
    closed: list[threading.Thread] = []

    async def get_leader(self: InMemoryProvider, group: str) -> None:
        raise ProviderError("memory get_leader failed") from socket.gaierror(-2, "unknown")

    async def aclose(self: InMemoryProvider) -> None:
        closed.append(threading.current_thread())

    monkeypatch.setattr(InMemoryProvider, "get_leader", get_leader)
    monkeypatch.setattr(InMemoryProvider, "aclose", aclose)
    election = sync_module.LeaderElection(
        "memory://probe-test", loop_factory=clock.new_event_loop, probe_timeout=2
    )
    with pytest.raises(ProviderError) as info, election:
        pytest.fail("the with block must not be entered")
    assert info.value.reason is FailureReason.NAME_NOT_RESOLVED
    assert election.closed
    assert len(closed) == 1
