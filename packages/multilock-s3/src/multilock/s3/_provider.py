"""`S3Provider`: one JSON object per group in an S3 bucket, written only conditionally.

Guarantees: the object ``<prefix><group>.json`` holds ``participant``, ``token``,
``metadata``, ``acquired_at``, ``lease`` and ``state`` (held or free). It is created with
``If-None-Match: *`` and every later write (renew, take-over, release) carries
``If-Match: <etag>`` of the version the writer checked, so of many concurrent writers
exactly one wins and the rest get 412. S3 has no expiry, so expiry is judged by
*observed time*: this provider treats a held record as expired only once it has seen the
same ETag unchanged for a full lease on its own ``time.monotonic()`` clock (timed from when
the read or write that showed the ETag came back). Timestamps written by other hosts are
never compared with the local clock. Each write stores a fresh random ``write`` id, so
every write makes a new ETag. A new term gets ``token + 1``; release writes a free
record that keeps the token, so tokens rise across release, expiry and restarts of every
participant, as long as the object is not deleted. The holder renews with ``If-Match`` of
the ETag it last wrote (a 412 means it lost the term). A live term is never shared: while
the record is held and live, ``try_acquire`` returns None whoever holds it, even a caller
with the holder's participant id, and writes nothing.

A follower of a crashed leader takes over between one lease and one lease plus one
``poll_interval`` after the leader's last write; a fresh provider must watch an object for
a full lease before it calls a held record expired. S3 cannot notify: ``watch`` polls
(the kit's `poll_watch`): it yields when the holder changes and exactly when the lease it
observes becomes due, never on a renewal.

Failure modes: network errors, timeouts and unexpected answers raise `ProviderError`
(the cause chained, no credential or signature in the message). Every request is bounded
by ``timeout`` and never retried here, except a release whose conditional write lost to
a write of its own term (a renew in flight): it reads again and retries while the record
still names its participant and token. A write whose reply is lost makes the next renew
of that term re-read the object, so a lost reply does not end a live term (the election
finds a term whose acquire reply was lost with ``get_leader``, by its metadata). A
cancelled call waits for its request to finish; a cancelled acquire that won a new term
gives it up at once (unless the cancel came after the request had already returned).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import urllib3
from minio.error import MinioException

from multilock.core.provider import (
    ConfigurationError,
    DriverCalls,
    LeaderInfo,
    Observed,
    Provider,
    poll_watch,
    to_seconds,
)

from ._config import check_bucket, check_prefix, parse_url
from ._record import Seen, check_record, info, make_record
from ._store import BadResponse, Store, strip_query

__all__ = ["S3Provider"]

log = logging.getLogger(__name__)

#: Reads and conditional writes a release tries while its own term's writes race it.
_RELEASE_TRIES = 3

T = TypeVar("T")
_FAILURES = (urllib3.exceptions.HTTPError, OSError, MinioException, BadResponse, ValueError)


class _Failed(Exception):
    """A driver failure, its message without the presigned URLs' signatures."""


class S3Provider(Provider):
    """Keep leases in ``bucket`` at ``endpoint`` (``host[:port]``), one object per group.

    Credentials are ``access_key``/``secret_key`` (plus ``session_token``), or a minio
    ``credentials`` provider; none means anonymous requests. ``secure`` picks HTTPS,
    ``cert_check`` and ``ca_certs`` configure its certificate check. ``timeout`` bounds each
    request (connect and read); ``poll_interval`` is how often ``watch`` reads the object.
    ``create_bucket`` makes the bucket on first use when it is missing.
    """

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        credentials: Any = None,
        region: str | None = None,
        prefix: str = "multilock/",
        secure: bool = True,
        cert_check: bool = True,
        ca_certs: str | None = None,
        timeout: float | timedelta = 5.0,
        poll_interval: float | timedelta = 1.0,
        create_bucket: bool = False,
    ) -> None:
        self._bucket = check_bucket(bucket)
        self._prefix = check_prefix(prefix)
        self._timeout = to_seconds(timeout, "timeout")
        self._poll = to_seconds(poll_interval, "poll_interval")
        self._where = f"{'https' if secure else 'http'}://{endpoint}/{self._bucket}"
        try:
            self._store = Store(
                endpoint,
                self._bucket,
                access_key=access_key,
                secret_key=secret_key,
                session_token=session_token,
                region=region,
                secure=secure,
                cert_check=cert_check,
                ca_certs=ca_certs,
                timeout=self._timeout,
                credentials=credentials,
            )
        except ValueError as exc:
            raise ConfigurationError(f"bad S3 endpoint {endpoint!r}: {exc}") from None
        # A call sends up to two requests in a row, each bounded by connect + read timeouts.
        self._calls = DriverCalls(
            "s3",
            self._where,
            timeout=4 * self._timeout,
            failures=(_Failed,),
            secrets=(secret_key or "", session_token or ""),
        )
        self._bucket_ready = not create_bucket
        self._lock = threading.Lock()
        #: group -> (etag, monotonic time it was first seen): the observed-time clock.
        self._seen: dict[str, tuple[str, float]] = {}
        #: group -> (participant, token, acquired_at, ETag of this provider's last write).
        self._mine: dict[str, tuple[str, int, str, str]] = {}

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Provider:
        """Build from ``s3://[key:secret@]host[:port]/bucket[/prefix/]?option=value``.

        ``s3://`` uses HTTPS, ``s3+http://`` plain HTTP. Query options: ``region``,
        ``session_token``, ``timeout``, ``poll_interval``, ``cert_check``, ``ca_certs``,
        ``create_bucket``. Keyword arguments win over the URL.
        """
        endpoint, bucket, options = parse_url(url)
        return cls(endpoint, bucket, **{**options, **kwargs})

    def __repr__(self) -> str:
        return f"<S3Provider {self._where} prefix={self._prefix!r}>"

    @property
    def requests_sent(self) -> int:
        """How many HTTP requests this provider has sent to the store (for metrics)."""
        return self._store.requests

    def _key(self, group: str) -> str:
        return f"{self._prefix}{group}.json"

    async def _call(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking *fn* in a worker thread; a cancelled caller waits for it to end."""
        return await self._calls.blocking(op, self._guarded, fn, *args)

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            if not self._bucket_ready:
                self._store.ensure_bucket()
                self._bucket_ready = True
            return fn(*args)
        except _FAILURES as exc:
            detail = strip_query(str(exc).strip()) or "no detail"
            raise _Failed(f"{type(exc).__name__}: {detail}") from exc

    # -- observed time -----------------------------------------------------------------

    def _read(self, group: str) -> Seen | None:
        """Read *group*'s object (None: it does not exist) and note when its ETag was new."""
        found = self._store.get(self._key(group))
        if found is None:
            return None
        return Seen(found[0], check_record(found[1]), self._observe(group, found[0]))

    def _observe(self, group: str, etag: str) -> float:
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(group)
            if seen is None or seen[0] != etag:
                self._seen[group] = seen = (etag, now)
            return seen[1]

    def _write(self, group: str, record: dict[str, Any], if_match: str | None) -> str | None:
        """Write *record* conditionally; remember the new ETag as this term's last write."""
        record = {**record, "write": uuid.uuid4().hex}  # every write makes a new ETag
        with self._lock:
            self._mine.pop(group, None)  # if the reply is lost, the next renew re-reads
        etag = self._store.put(self._key(group), record, if_match=if_match)
        if etag is not None:
            self._observe(group, etag)
            if record["state"] == "held":
                term = (record["participant"], record["token"], record["acquired_at"], etag)
                with self._lock:
                    self._mine[group] = term
        return etag

    # -- the provider interface ------------------------------------------------------

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        # Cancelled (or timed out) callers never learn of a term the worker then wins.
        task = asyncio.current_task()
        abandoned = (lambda: task.cancelling() > 0) if task is not None else (lambda: False)
        return await self._call(
            "try_acquire",
            self._acquire,
            *(group, participant_id, lease_duration, metadata, abandoned),
        )

    def _acquire(
        self,
        group: str,
        participant_id: str,
        lease: float,
        meta: dict[str, str],
        abandoned: Callable[[], bool],
    ) -> LeaderInfo | None:
        seen = self._read(group)
        if seen is not None and seen.live():
            return None  # held, whoever holds it: a live term is never shared
        token = 1 if seen is None else int(seen.record["token"]) + 1
        acquired_at = datetime.now(UTC).isoformat()
        record = make_record("held", participant_id, token, lease, meta, acquired_at)
        written = self._write(group, record, None if seen is None else seen.etag)
        if written is None:
            return None
        if abandoned():
            # The caller was cancelled and will never learn of this term: end it now.
            log.debug("try_acquire of %s was cancelled after it won; releasing", group)
            self._write(group, {**record, "state": "free"}, written)
            return None
        return info(record)

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        args = (group, participant_id, token, lease_duration, metadata)
        return await self._call("renew", self._renew, *args)

    def _renew(
        self, group: str, participant_id: str, token: int, lease: float, meta: dict[str, str]
    ) -> bool:
        with self._lock:
            mine = self._mine.get(group)
        if mine is not None and mine[:2] == (participant_id, token):
            acquired_at, etag = mine[2], mine[3]  # a 412 on this ETag means the term is gone
        else:
            # Not written by this provider (or the last reply was lost): check the record.
            seen = self._read(group)
            if seen is None or not seen.holds(participant_id, token) or not seen.live():
                return False
            acquired_at, etag = str(seen.record["acquired_at"]), seen.etag
        record = make_record("held", participant_id, token, lease, meta, acquired_at)
        return self._write(group, record, etag) is not None

    async def release(self, group: str, participant_id: str, token: int) -> None:
        await self._call("release", self._release, group, participant_id, token)

    def _release(self, group: str, participant_id: str, token: int) -> None:
        # A 412 means the record changed since it was read: by a takeover (then the term
        # is not ours to release), or by a write of this very term (its renew landing
        # first), which must not keep the lease alive: read again and retry while the
        # record still names this participant and token.
        for _ in range(_RELEASE_TRIES):
            seen = self._read(group)
            if seen is None or seen.record.get("state") != "held":
                return
            if not seen.holds(participant_id, token):
                return
            old = seen.record
            free = make_record("free", participant_id, token, old["lease"], {}, old["acquired_at"])
            if self._write(group, free, seen.etag) is not None:
                return

    async def get_leader(self, group: str) -> LeaderInfo | None:
        return await self._call("get_leader", self._leader, group)

    def _leader(self, group: str) -> LeaderInfo | None:
        seen = self._read(group)
        return info(seen.record) if seen is not None and seen.live() else None

    @property
    def notify_delay(self) -> float:
        """A follower sees a release at its watch's next GET: up to ``poll_interval``."""
        return self._poll

    def watch(self, group: str) -> AsyncIterator[None]:
        """Yield at once, then whenever the holder (participant, token, state) changes, and
        exactly when the lease this provider observes is due; poll every ``poll_interval``.

        A renewal changes the ETag but not the holder: it only restarts the observed lease.
        """

        async def read() -> Observed:
            seen = await self._call("watch", self._read, group)
            if seen is None:
                return Observed(None)
            record = seen.record
            holder = (record["state"], record["participant"], record["token"])
            if record["state"] != "held":
                return Observed(holder, seen.etag)
            left = seen.since + float(record["lease"]) - time.monotonic()
            return Observed(holder, seen.etag, left)

        return poll_watch(read, self._poll)

    async def aclose(self) -> None:
        """Drop the connection pool; later calls raise `ProviderError`. Idempotent."""
        if not self._calls.closed:
            self._calls.closed = True
            self._store.close()
