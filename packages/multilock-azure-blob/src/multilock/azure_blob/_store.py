"""`BlobStore`: the few requests the provider makes, bounded, with errors made safe."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from azure.core import MatchConditions
from azure.core.exceptions import (
    AzureError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
)
from azure.storage.blob.aio import BlobClient, BlobLeaseClient, ContainerClient

from multilock.core.provider import ConfigurationError, DriverCalls, ProviderError

from ._config import secrets_of_connection_string, secrets_of_credential
from ._record import Record

__all__ = ["BlobStore"]

T = TypeVar("T")


class _Failed(Exception):
    """A failed request, told in the first line of the driver's message."""


class _Answer(Exception):
    """An expected status (404, 409, 412): an answer, carried past `DriverCalls`."""

    def __init__(self, error: HttpResponseError) -> None:
        super().__init__(error.status_code)
        self.error = error


class BlobStore:
    """One container; every request bounded by *timeout*, without driver retries.

    Statuses that are answers (404, 409, 412) come back as the driver's errors where a
    caller expects them; every other failure is a `ProviderError` without credentials.
    """

    def __init__(
        self,
        container: str,
        *,
        connection_string: str | None,
        account_url: str | None,
        credential: Any,
        prefix: str,
        timeout: float,
        client_kwargs: Mapping[str, Any],
    ) -> None:
        self.prefix = prefix
        self.timeout = timeout
        if (connection_string is None) == (account_url is None):
            raise ConfigurationError("give exactly one of connection_string and account_url")
        options: dict[str, Any] = {
            "retry_total": 0,  # the core owns retries
            "connection_timeout": timeout,
            "read_timeout": timeout,
            **client_kwargs,
        }
        if connection_string is not None:
            secrets = secrets_of_connection_string(connection_string)
        else:
            secrets = secrets_of_credential(credential)
        self.calls = DriverCalls(
            "azure blob", "Azure", timeout=timeout, failures=(_Failed,), secrets=secrets
        )
        try:
            if connection_string is not None:
                self.client = ContainerClient.from_connection_string(
                    connection_string, container, credential=credential, **options
                )
            else:
                self.client = ContainerClient(
                    str(account_url), container, credential=credential, **options
                )
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(
                f"invalid Azure Blob settings: {self.calls.scrub(str(exc))}"
            ) from None
        self.where = self.calls.where = self.client.primary_endpoint.split("?")[0]
        self._container_ready = False

    async def call(
        self, op: str, call: Callable[[], Awaitable[T]], expected: tuple[int, ...] = ()
    ) -> T:
        """Run one request, bounded by ``timeout``; wrap failures but the *expected* statuses.

        An expected status (404, 409, 412) is an answer, re-raised as the driver's error.
        """

        async def answered() -> T:
            try:
                return await call()
            except HttpResponseError as exc:
                if exc.status_code in expected:
                    raise _Answer(exc) from None
                raise _Failed(_first_line(exc)) from exc
            except (AzureError, OSError) as exc:
                raise _Failed(_first_line(exc)) from exc

        try:
            return await self.calls.call(op, answered())
        except _Answer as answer:
            raise answer.error from None

    def blob(self, group: str) -> BlobClient:
        return self.client.get_blob_client(self.prefix + group)

    async def ensure_container(self) -> None:
        if self._container_ready:
            return
        with contextlib.suppress(ResourceExistsError):
            await self.call("create container", self.client.create_container, (409,))
        self._container_ready = True

    async def read(self, group: str) -> Record:
        """The group's record and lease status, in one GET; a free record if no blob."""
        blob = self.blob(group)

        async def get() -> tuple[bytes, Any]:
            stream = await blob.download_blob()
            return await stream.readall(), stream.properties

        try:
            body, props = await self.call("read", get, (404,))
        except ResourceNotFoundError as exc:
            if getattr(exc, "error_code", None) == "ContainerNotFound":
                self._container_ready = False  # deleted behind our back: make it again
            return Record()
        try:
            data = json.loads(body)
            return Record(**data, etag=props.etag, locked=props.lease.status == "locked")
        except (ValueError, TypeError) as exc:
            raise ProviderError(f"the blob of {group!r} on {self.where} is not ours") from exc

    async def write(self, group: str, record: Record, lease_id: str | None, etag: str) -> str:
        """Replace the record if its ETag is still *etag* (under *lease_id*, if leased).

        Return the new ETag; a changed blob or a wrong or missing lease id is a 412.
        """
        data = record.dumps()

        async def put() -> Any:
            return await self.blob(group).upload_blob(
                data,
                overwrite=True,
                lease=lease_id,  # type: ignore[arg-type]  # a lease id str works too
                etag=etag,
                match_condition=MatchConditions.IfNotModified,
            )

        reply = await self.call("write", put, (409, 412))
        return str(reply["etag"])

    async def take_lease(self, group: str, lease_id: str, seconds: int, etag: str) -> bool:
        """Acquire (or extend, when it is already ours) the lease, if the blob is unchanged."""
        lease = BlobLeaseClient(self.blob(group), lease_id=lease_id)

        async def acquire() -> None:
            await lease.acquire(
                lease_duration=seconds, etag=etag, match_condition=MatchConditions.IfNotModified
            )

        try:
            await self.call("acquire lease", acquire, (404, 409, 412))
        except HttpResponseError:  # 409: leased by another id; 412: the record changed
            return False
        return True

    async def give_back(self, group: str, lease_id: str) -> None:
        lease = BlobLeaseClient(self.blob(group), lease_id=lease_id)
        with contextlib.suppress(HttpResponseError):
            await self.call("release lease", lease.release, (409, 412))

    async def create(self, group: str, record: Record) -> None:
        """Create the group's blob holding *record*, unless it exists."""
        with contextlib.suppress(ResourceExistsError):
            await self.call(
                "create",
                lambda: self.blob(group).upload_blob(record.dumps(), overwrite=False),
                (409,),
            )

    async def aclose(self) -> None:
        if not self.calls.closed:
            self.calls.closed = True
            await self.client.close()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
