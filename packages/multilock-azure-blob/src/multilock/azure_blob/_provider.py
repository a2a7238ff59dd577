"""`AzureBlobProvider`: one blob per group, held by a blob lease; followers poll.

Guarantees: the holder of a group is whoever holds the blob's *lease*, judged by Azure's
clock alone; the blob's JSON record (participant, token, metadata, acquired_at) is written
with ``If-Match`` on the ETag just read, so every write is one compare-then-act. A new
term writes ``token + 1`` on the free blob, then takes the lease with ``If-Match`` on the
ETag of that very write: a leased blob's record always names the lease's holder, and of
racing candidates only one gets both steps through. From then on writes need the lease id
(Azure refuses others with 412): renew rewrites the record, release writes it free
(keeping the token) and releases the lease. Tokens rise across release, expiry and
restarts of this process, for as long as the blob exists. ``get_leader`` reads the lease
status with the record and reports nobody unless the blob is leased: a stale record is
never a leader.

A live term is never shared: while the blob is leased, ``try_acquire`` returns None
whoever holds it, even a caller with the holder's participant id, and sends no write.
Lease ids are ``uuid5(<random per provider>, group/participant)``: the provider derives
the id again for renew and release, so it keeps no state per term, and a term whose
acquire reply was lost (the election finds it with ``get_leader``, by its metadata) can
still be renewed and released by the provider that took it; another provider, even with
the same participant id, proposes a different id and cannot touch it. A cancelled acquire
gives back the lease it may have taken. A release whose write lost to a write of its own
term (a renew in flight) reads again and retries while the record still names its
participant, token and lease.

Failure modes: every driver error or timeout raises `ProviderError` (credentials
scrubbed), with no driver retries (the core owns retries); 409/412 answers mean "someone
else holds it" and give None / False. Azure leases last 15 to 60 whole seconds: lease
durations are rounded up to whole seconds, shorter ones are refused, longer ones (only
possible when calling the provider directly) take an *infinite* lease, ended only by a
release. Deleting the blob resets its token. Azure cannot notify: `watch` polls (the kit's
`poll_watch`, see there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
from azure.core.exceptions import HttpResponseError

from multilock.core.provider import LeaderInfo, LeaseBounds, Observed, Provider, poll_watch

from ._config import parse_url, seconds, validate_container, validate_prefix
from ._record import MAX_LEASE, MIN_LEASE, Record, lease_seconds, tag
from ._store import BlobStore

__all__ = ["AzureBlobProvider"]

log = logging.getLogger(__name__)

#: Reads and conditional writes a release tries while its own term's writes race it.
_RELEASE_TRIES = 3

_BOUNDS = LeaseBounds(
    minimum=MIN_LEASE,
    maximum=MAX_LEASE,
    reason="Azure blob leases last 15 to 60 s, rounded up to whole seconds",
)


class AzureBlobProvider(Provider):
    """Keep one leased blob per group in *container* (created if missing).

    Give ``connection_string`` or ``account_url`` (with ``credential``: an account key,
    a SAS token, an ``AzureNamedKeyCredential`` or an azure-identity async credential).
    Blobs are named ``prefix + group``. ``poll_interval`` paces `watch`; ``timeout``
    bounds each request. Other keywords go to azure-storage-blob's ``ContainerClient``
    (e.g. ``api_version``). Durations are float seconds or `timedelta`.
    """

    def __init__(
        self,
        container: str = "multilock",
        *,
        connection_string: str | None = None,
        account_url: str | None = None,
        credential: Any = None,
        prefix: str = "multilock/",
        poll_interval: float | timedelta | str = 2.0,
        timeout: float | timedelta | str = 10.0,
        **client_kwargs: Any,
    ) -> None:
        validate_container(container)
        self._prefix = validate_prefix(prefix)
        self._poll = seconds(poll_interval, "poll_interval")
        self._store = BlobStore(
            container,
            connection_string=connection_string,
            account_url=account_url,
            credential=credential,
            prefix=self._prefix,
            timeout=seconds(timeout, "timeout"),
            client_kwargs=client_kwargs,
        )
        self._namespace = uuid.uuid4()  # makes lease ids unique to this provider

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> AzureBlobProvider:
        """Build from ``azureblob://<account>.blob.core.windows.net/<container>?...``.

        See `multilock.azure_blob._config` for the forms; keywords win over the URL.
        """
        return cls(**parse_url(url, kwargs))

    def __repr__(self) -> str:
        return f"<AzureBlobProvider {self._store.where} prefix={self._prefix!r}>"

    @property
    def lease_bounds(self) -> LeaseBounds:
        """Azure's blob leases: 15 to 60 s (rounded up to whole seconds)."""
        return _BOUNDS

    def _lease_id(self, group: str, participant: str) -> str:
        return str(uuid.uuid5(self._namespace, f"{group}/{participant}"))

    # -- the provider interface -------------------------------------------------------------

    @property
    def notify_delay(self) -> float:
        """Up to ``poll_interval``: a release shows at the watch's next read of the blob."""
        return self._poll

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        seconds = lease_seconds(lease_duration)
        await self._store.ensure_container()
        record = await self._store.read(group)
        if record.etag is None:
            await self._store.create(group, record)
            record = await self._store.read(group)
        assert record.etag is not None
        if record.locked:
            return None  # held, whoever holds it: a live term is never shared
        lease_id = self._lease_id(group, participant_id)
        now = datetime.now(UTC).isoformat()
        new = Record(
            participant_id, record.token + 1, dict(metadata), now, tag(lease_id), lease_duration
        )
        try:
            # Record first, then the lease on exactly that record: a leased blob's record
            # always names its holder. Writing without a lease id fails on a leased blob.
            etag = await self._store.write(group, new, None, record.etag)
            if not await self._store.take_lease(group, lease_id, seconds, etag):
                return None
        except asyncio.CancelledError:
            # Leave nothing behind: give back the lease this call may have taken.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._store.timeout):
                    await asyncio.shield(self._store.give_back(group, lease_id))
            raise
        except HttpResponseError:  # 412: the blob changed under us: someone else's term
            return None
        return new.info()

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        seconds = lease_seconds(lease_duration)
        lease_id = self._lease_id(group, participant_id)
        record = await self._store.read(group)
        if not self._holds(record, participant_id, token, lease_id):
            return False
        assert record.etag is not None
        if not await self._store.take_lease(group, lease_id, seconds, record.etag):
            return False
        # Written on every renew: the new ETag tells watchers the lease was extended.
        new = attrs.evolve(record, metadata=dict(metadata), lease_duration=lease_duration)
        try:
            await self._store.write(group, new, lease_id, record.etag)
        except HttpResponseError:
            return False
        return True

    async def release(self, group: str, participant_id: str, token: int) -> None:
        lease_id = self._lease_id(group, participant_id)
        # A failed write means the record changed since it was read: by a takeover (then
        # the term is not ours to release), or by a write of this very term (its renew
        # landing first), which must not keep the lease alive: read again and retry
        # while the record still names this participant, token and lease.
        for _ in range(_RELEASE_TRIES):
            record = await self._store.read(group)
            if not self._holds(record, participant_id, token, lease_id):
                return
            assert record.etag is not None
            try:
                await self._store.write(group, Record(token=record.token), lease_id, record.etag)
            except HttpResponseError:
                continue
            await self._store.give_back(group, lease_id)
            return

    @staticmethod
    def _holds(record: Record, participant_id: str, token: int, lease_id: str) -> bool:
        return (
            record.locked
            and record.participant == participant_id
            and record.token == token
            and record.lease == tag(lease_id)
        )

    async def get_leader(self, group: str) -> LeaderInfo | None:
        record = await self._store.read(group)
        if not record.locked or record.participant is None:
            return None  # a record without a live lease is history, not a leader
        return record.info()

    def watch(self, group: str) -> AsyncIterator[None]:
        """Poll every ``poll_interval``; yield at the first read, then when the leader or
        the lease status changes, and when the lease seen is due to expire.

        Expiry is tracked on the local monotonic clock: each renew rewrites the record, so
        a lease whose record (ETag) stayed the same for ``lease_duration`` since this
        watch first saw it has ended; the watch reads right then and yields.
        """

        async def read() -> Observed:
            record = await self._store.read(group)
            holder = (record.locked, record.participant, record.token)
            expires_in = record.lease_duration if record.locked else None
            return Observed(holder, (record.etag, record.locked), expires_in)

        return poll_watch(read, self._poll)

    async def aclose(self) -> None:
        """Close the HTTP session; later calls raise. Idempotent."""
        await self._store.aclose()
