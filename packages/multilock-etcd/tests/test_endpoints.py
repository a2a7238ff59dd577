"""Several members of one cluster: the URL and ``endpoints`` forms, their mistakes, and
moving on to the next member when one fails (against closed ports: no server needed).

The failover against a real three-member cluster is in the repository's cluster campaign.
"""

from __future__ import annotations

import asyncio
import re
import socket

import pytest

from multilock.core import ConfigurationError, ProviderError
from multilock.core.testing import error_texts as texts
from multilock.etcd import EtcdProvider
from multilock.etcd._provider import _Client

PASSWORD = "Corr3ct-h0rse"


def _unused_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def test_the_url_names_every_member_in_order() -> None:
    provider = EtcdProvider.from_url("etcd://u:p@e1:2400,e2,[::1]:2402/app?timeout=2")
    assert provider._members == [("e1", 2400), ("e2", 2379), ("::1", 2402)]
    assert repr(provider) == "<EtcdProvider e1:2400,e2:2379,[::1]:2402 prefix='app'>"
    assert provider._calls.where == "e1:2400"  # the first member is used first
    assert provider._auth == {"username": "u", "password": "p"}


def test_endpoints_keyword() -> None:
    provider = EtcdProvider(endpoints=["e1:2400", "e2"], prefix="x")
    assert provider._members == [("e1", 2400), ("e2", 2379)]
    assert repr(EtcdProvider()) == "<EtcdProvider localhost:2379 prefix='multilock'>"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("etcd://e1,,e3", "no host in the etcd URL, member 2 of 3;"),
        ("etcd://e1:2379,e2:x", "bad port (1 to 65535) in the etcd URL, member 2 of 2 ("),
        ("etcd://e1:0", "bad port (1 to 65535) in the etcd URL ("),
        ("etcd://e1:2379,", "no host in the etcd URL, member 2 of 2;"),
        ("etcd://e1,e2:2379,e1:2379", "member 3 of the etcd URL repeats member 1;"),
        ("etcd://::1", "an IPv6 address goes in brackets, as in [::1]:2379 in the etcd URL;"),
        ("etcd://[::1:2379", "an IPv6 address goes in brackets"),
        ("etcd://[::1]x", "an IPv6 address goes in brackets"),
    ],
)
def test_bad_member_lists_say_which_member_and_what(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        EtcdProvider.from_url(url)
    assert message in str(caught.value)
    assert str(caught.value).endswith(
        "the form is etcd://[user:pass@]host[:port][,host[:port]...][/prefix]"
    )


def test_a_bad_member_never_shows_the_password() -> None:
    for url in [
        f"etcd://u:{PASSWORD}@e1,e2:x",
        f"etcd://u:{PASSWORD}/x@e1,e2",  # the '/' cuts the password: its half is the "port"
    ]:
        with pytest.raises(ConfigurationError) as caught:
            EtcdProvider.from_url(url)
        assert "bad port" in str(caught.value)
        assert all(PASSWORD not in text for text in texts(caught.value))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"endpoints": ["e1"], "host": "e2"}, "give an etcd host and port, or endpoints, not both"),
        ({"endpoints": ["e1"], "port": 2379}, "give an etcd host and port, or endpoints, not both"),
        ({"endpoints": "e1:2379,e2:2379"}, "endpoints is a list of 'host:port' strings"),
        ({"endpoints": []}, "endpoints is a list of 'host:port' strings"),
        ({"endpoints": ["e1", "e2:port"]}, "bad etcd endpoint 'e2:port': bad port"),
        ({"endpoints": ["e1", "e1:2379"]}, "etcd endpoint 'e1:2379' is named twice"),
        ({"host": "", "port": 2379}, "bad etcd address"),
    ],
)
def test_bad_endpoints_are_configuration_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match="^" + re.escape(message)):
        EtcdProvider(**kwargs)  # type: ignore[arg-type]


async def test_a_failed_member_makes_the_next_calls_go_to_the_next_member() -> None:
    ports = _unused_ports(3)
    members = [f"127.0.0.1:{port}" for port in ports]
    async with EtcdProvider(endpoints=members, timeout=1) as provider:
        seen = []
        for _ in range(4):
            seen.append(provider._calls.where)
            with pytest.raises(ProviderError, match=f"failed on {seen[-1]}"):
                await provider.get_leader("g")
        assert seen == [*members, members[0]]  # round and round


async def test_calls_failing_together_move_on_once() -> None:
    members = [f"127.0.0.1:{port}" for port in _unused_ports(3)]
    async with EtcdProvider(endpoints=members, timeout=1) as provider:
        failures = await asyncio.gather(
            *(provider.get_leader("g") for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(f, ProviderError) for f in failures)
        assert provider._calls.where == members[1]


async def test_one_member_is_kept_whatever_happens() -> None:
    (port,) = _unused_ports(1)
    async with EtcdProvider("127.0.0.1", port, timeout=1) as provider:
        client = provider._client
        with pytest.raises(ProviderError):
            await provider.get_leader("g")
        assert provider._client is client  # gRPC reconnects by itself


async def test_every_call_and_watch_requires_a_leader() -> None:
    # etcd's "hasleader" header: a member cut off from its peers refuses at once.
    client = _Client(host="127.0.0.1", port=_unused_ports(1)[0])
    try:
        await client.connect()  # no authentication: no I/O
        assert ("hasleader", "true") in client.metadata
        assert client._watcher._metadata == client.metadata
        await client.connect()
        assert client.metadata.count(("hasleader", "true")) == 1
    finally:
        await client.close()


class _Stub:
    """A client whose get waits for *go*, then ends as gRPC ends the calls of a channel
    it closes (or sleeps on, with *hang*)."""

    def __init__(self, *, hang: bool = False) -> None:
        self.go, self.started, self.hang = asyncio.Event(), asyncio.Event(), hang

    async def get(self, key: bytes) -> None:
        self.started.set()
        await self.go.wait()
        if self.hang:
            await asyncio.sleep(10)
        raise asyncio.CancelledError

    async def close(self) -> None:
        pass


async def test_a_call_on_a_client_closed_by_moving_on_fails_without_cancelling() -> None:
    # gRPC cancels the calls in flight on a channel it closes: their callers saw a
    # CancelledError, which ended an election's loop instead of failing one round.
    async with EtcdProvider(endpoints=["127.0.0.1:1", "127.0.0.1:2"], timeout=1) as provider:
        stub = provider._client = _Stub()
        call = asyncio.ensure_future(provider.get_leader("g"))
        await stub.started.wait()
        provider._move_on(stub, ProviderError("test: the member failed"))
        stub.go.set()
        with pytest.raises(ProviderError, match="its connection was closed when the provider"):
            await call


async def test_a_cancelled_caller_is_still_cancelled() -> None:
    async with EtcdProvider(endpoints=["127.0.0.1:1", "127.0.0.1:2"], timeout=1) as provider:
        stub = provider._client = _Stub(hang=True)
        call = asyncio.ensure_future(provider.get_leader("g"))
        await stub.started.wait()
        provider._move_on(stub, ProviderError("test: the member failed"))
        stub.go.set()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call


async def test_a_cancellation_on_the_current_client_is_passed_on() -> None:
    async with EtcdProvider(endpoints=["127.0.0.1:1", "127.0.0.1:2"], timeout=1) as provider:
        stub = provider._client = _Stub()
        stub.go.set()
        with pytest.raises(asyncio.CancelledError):
            await provider.get_leader("g")
