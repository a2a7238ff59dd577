"""Every provider refuses, at its URL, a password cut short by an unencoded '/', '?' or '#',
and no part of that password is in the error or anything chained to it.

urllib ends a URL's host part at the first of those characters, so the start of such a
password reads as the port (``redis://:Xq7f/Zr9k@host`` has the port ``Xq7f``). A URL
parser's error, a driver's "cannot resolve host" or a host-list check would quote it.
"""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from multilock.core import (
    ConfigurationError,
    LeaderElection,
    available_schemes,
    from_url,
    redact_url,
)
from multilock.core.testing import error_texts

FIRST, SECOND = "Xq7f", "Zr9k"  # the password's two halves

#: One URL a scheme (with its user, hosts and path), the password standing for {pw}.
URLS = {
    "redis": "redis://:{pw}@localhost:6379/0",
    "rediss": "rediss://user:{pw}@localhost/0",
    "redis+sentinel": "redis+sentinel://:{pw}@s1:26379,s2:26379/mymaster",
    "redlock": "redlock://:{pw}@h1:6379,h2:6379,h3:6379/0",
    "postgresql": "postgresql://app:{pw}@localhost:5432/db",
    "postgres": "postgres://app:{pw}@db1:5432,db2:5432/db",
    "zookeeper": "zookeeper://app:{pw}@localhost:2181/chroot",
    "zk": "zk://app:{pw}@z1:2181,z2:2181",
    "etcd": "etcd://app:{pw}@localhost:2379",
    "s3": "s3://AKIAEXAMPLE:{pw}@localhost:9000/bucket",
    "s3+http": "s3+http://AKIAEXAMPLE:{pw}@localhost:9000/bucket",
    "azureblob": "azureblob://account:{pw}@localhost:10000/leases",
    "consul": "consul://:{pw}@localhost:8500",
    "mssql": "mssql://sa:{pw}@localhost:1433/db",
    "sqlserver": "sqlserver://sa:{pw}@localhost/db",
}


def test_every_scheme_with_credentials_is_covered() -> None:
    assert set(available_schemes()) - {"memory", "file"} == set(URLS)


#: A URL a scheme whose query may carry a secret, standing for {pw}.
QUERY_SECRETS = {
    "redis": "redis://localhost:6379/0?password={pw}",
    "postgresql": "postgresql://app@localhost/db?password={pw}",
    "consul": "consul://localhost:8500?token={pw}",
    "azureblob": "azureblob://account@localhost:10000/leases?sas={pw}",
    "s3": "s3://AKIAEXAMPLE:x@localhost:9000/bucket?session_token={pw}",
    "mssql": "mssql://sa@localhost/db?PWD={pw}",
}


#: Every URL above with its secret cut by each character that cuts it.
CUT = [
    *((template, cut) for template in URLS.values() for cut in "/?#"),
    *((template, cut) for template in QUERY_SECRETS.values() for cut in "&#"),
]


@pytest.mark.parametrize(("template", "cut"), CUT)
def test_a_secret_cut_by_an_unencoded_character_is_refused_unquoted(
    template: str, cut: str
) -> None:
    # Before, for one or another: urllib's "Port could not be cast to integer value as
    # 'Xq7f'", kazoo's bare ValueError, "unknown option 'Zr9k'", redis-py's "bad query
    # field: 'Zr9k'", or a repr ending in "&Zr9k=" or "#Zr9k".
    url = template.format(pw=f"{FIRST}{cut}{SECOND}")
    with pytest.raises(ConfigurationError) as caught:
        from_url(url)
    texts = [*error_texts(caught.value), redact_url(url)]
    assert all(FIRST not in text and SECOND not in text for text in texts), texts
    assert "percent-encode" in str(caught.value)


@pytest.mark.parametrize("scheme", sorted(URLS))
def test_the_same_password_percent_encoded_is_taken(scheme: str) -> None:
    url = URLS[scheme].format(pw=f"{FIRST}%2F{SECOND}")
    provider = from_url(url)  # built, not connected: no server is needed
    assert FIRST not in repr(provider)
    assert SECOND not in repr(provider)


@pytest.mark.parametrize("scheme", sorted(URLS))
def test_an_at_sign_in_a_password_needs_no_encoding(scheme: str) -> None:
    # The last '@' ends the user information, as urllib reads it (libpq, which ends it
    # at the first, is given the password's '@' encoded: see multilock-postgres' tests).
    provider = from_url(URLS[scheme].format(pw=f"{FIRST}@{SECOND}"))
    assert FIRST not in repr(provider)
    assert SECOND not in repr(provider)


#: The lease each store can hold (the others take 2 s).
_LEASES = {"azureblob": 15.0, "consul": 10.0, "zookeeper": 10.0, "zk": 10.0}


@pytest.mark.parametrize("scheme", sorted(URLS))
async def test_no_log_record_holds_the_password(
    scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Every logger at DEBUG, the drivers' too, while an election fails to reach the
    # store (port 1 on the loopback: nothing listens), until it warns; then it stops.
    hosts = iter(range(1, 10))  # each host of a list its own loopback address
    url = re.sub(
        r"(?<=[@,])(localhost|[a-z]+\d)(:\d+)?",
        lambda _: f"127.0.0.{next(hosts)}:1",
        URLS[scheme],
    )
    quick = "?connect_timeout=0.5" if scheme in ("zookeeper", "zk") else ""  # default 10 s
    provider = from_url(url.format(pw=f"{FIRST}%2F{SECOND}") + quick)
    caplog.set_level(logging.DEBUG)
    election = LeaderElection(
        provider, group="g", lease_duration=_LEASES.get(scheme, 2.0), retry_interval=0.2
    )

    def warned() -> bool:  # the store's failure was logged, with what the driver said
        return any(r.name.startswith("multilock") and r.levelno >= 30 for r in caplog.records)

    try:
        await election.start()
        async with asyncio.timeout(10):
            while not warned():
                await asyncio.sleep(0.02)
    finally:
        await election.stop()
        await provider.aclose()
    records = [
        record.getMessage() + (caplog.handler.format(record) if record.exc_info else "")
        for record in caplog.records
    ]
    assert all(FIRST not in text and SECOND not in text for text in records)
