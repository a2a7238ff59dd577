"""`FileSystemProvider`: leases in files, for the processes of one machine.

Store: one JSON record per group, ``<group>.lease.json``, next to its lock file
``<group>.lease.lock`` (names that are long, contain capitals or are Windows device
names get a hash suffix, so case-insensitive file systems never merge two groups).
Every operation takes the `filelock` lock of its group, reads the record, decides and,
if it changes anything, writes ``<group>.lease.json.tmp``, fsyncs it, renames it over the
record with `os.replace` and fsyncs the directory. Readers therefore see the old record
or the new one, never a mix, and a crash mid-write leaves only the temp file behind.

Guarantees:

- One holder per group: the read-check-write runs under an exclusive lock shared by
  every process (and thread) of the machine.
- Fencing: the token counter lives in the record; release clears the holder but keeps
  the file, so tokens keep rising across release, expiry, crashes and restarts.
- Expiry is judged by one clock: the record stores ``expires_at`` on `time.monotonic`,
  which every process of one boot shares (Linux ``CLOCK_MONOTONIC``; on macOS and
  Windows too it is system-wide). That clock restarts at boot, so the record also names
  its boot: the kernel's boot id (Linux ``/proc/sys/kernel/random/boot_id``, macOS
  ``kern.bootsessionuuid``) and a boot-time estimate ``time.time() - time.monotonic()``.
  A record from another boot has expired. Where the kernel gives no boot id, estimates
  within ``BOOT_TIME_TOLERANCE`` (300 s) are one boot, so a wall-clock step larger than
  that while a lease is held could end the lease early. Wall clocks are never compared.
- A live term is never shared: while a lease is live, ``try_acquire`` returns None
  whoever holds it, even a caller with the holder's participant id, and leaves the record
  as it is.
- Cancellation: a call cancelled before its worker thread takes the lock does nothing;
  one cancelled later completes in its thread, so whoever locks next sees its write (the
  election finds such a term with ``get_leader``, by its metadata).
- `watch` polls the record's `os.stat` every ``poll_interval`` and reads the record only
  when it changed; it wakes followers on a new term or release, and exactly when the
  observed lease is due to expire.

Failure modes: a crashed holder's lease stays until it expires (the kernel frees its
lock at once). A record that cannot be parsed (corrupt, truncated, edited by hand) makes
every call on its group raise `ProviderError`; it is never taken over or overwritten.
A lock not taken within ``lock_timeout`` raises `ProviderError`. Deleting the directory
or a record resets that group's tokens. Network file systems are out of scope: their
locks and rename semantics vary and their hosts do not share a monotonic clock.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple, TypeVar
from urllib.parse import parse_qsl, urlsplit
from urllib.request import url2pathname

from filelock import FileLock, Timeout

from multilock.core import (
    ConfigurationError,
    LeaderInfo,
    Provider,
    ProviderError,
    redact_url,
    validate_name,
)
from multilock.core._names import to_seconds

from ._record import Record, new_lease, parse, write_atomic

__all__ = ["FileSystemProvider"]

T = TypeVar("T")

_WINDOWS_DEVICES = frozenset(
    {"con", "prn", "aux", "nul"} | {f"{p}{i}" for p in ("com", "lpt") for i in range(10)}
)
_URL_OPTIONS = frozenset({"poll_interval", "lock_timeout"})


class _Abandoned(Exception):
    """The caller was cancelled before this worker took the lock."""


class _Paths(NamedTuple):
    record: Path
    lock: Path
    temp: Path


# What an operation decides, given the record (None: no file yet) and the monotonic now:
# the record to write (None: write nothing) and the result to return.
_Step = Callable[[Record | None, float], tuple[Record | None, T]]


class FileSystemProvider(Provider):
    """Keep each group's lease in a file under *directory* (created if missing).

    Correct across the processes of one machine; not across machines (see the module
    docstring). ``poll_interval`` is how often `watch` checks the record for changes;
    ``lock_timeout`` bounds the wait for a group's file lock.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        poll_interval: float | timedelta = 0.5,
        lock_timeout: float | timedelta = 5.0,
    ) -> None:
        path = os.fspath(directory) if isinstance(directory, str | os.PathLike) else None
        if not isinstance(path, str) or not path:
            raise ConfigurationError("directory must be a non-empty str or os.PathLike[str]")
        self._poll_interval = to_seconds(poll_interval, "poll_interval")
        self._lock_timeout = to_seconds(lock_timeout, "lock_timeout")
        self._directory = Path(os.path.abspath(path))
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot use {str(self._directory)!r} as the lease directory: {exc}"
            ) from exc

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> FileSystemProvider:
        """Build from ``file:///absolute/path[?poll_interval=0.5&lock_timeout=5]``."""
        parts = urlsplit(url)
        shown = redact_url(url)
        if parts.scheme.lower() != "file":
            raise ConfigurationError(f"{shown!r} is not a file:// URL")
        if parts.netloc not in ("", "localhost"):
            raise ConfigurationError(
                f"file URL {shown!r} names the host {parts.netloc!r}: a file URL takes an "
                "absolute path after three slashes, file:///absolute/path; relative paths "
                "and remote hosts are not supported"
            )
        path = url2pathname(parts.path)
        if parts.fragment or not path or not os.path.isabs(path):
            raise ConfigurationError(
                f"file URL {shown!r} needs an absolute directory path: file:///absolute/path"
            )
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key not in _URL_OPTIONS:
                raise ConfigurationError(
                    f"unknown option {key!r} in file URL; known: {', '.join(sorted(_URL_OPTIONS))}"
                )
            if key in kwargs:
                raise ConfigurationError(f"{key} is given both in the URL and as a keyword")
            try:
                kwargs[key] = float(value)
            except ValueError:
                raise ConfigurationError(
                    f"{key} in file URL must be seconds, got {value!r}"
                ) from None
        return cls(path, **kwargs)

    @property
    def directory(self) -> Path:
        """The directory holding the lease records."""
        return self._directory

    def __repr__(self) -> str:
        return f"<FileSystemProvider directory={str(self._directory)!r}>"

    def _paths(self, group: str) -> _Paths:
        stem = validate_name(group, "group")
        if len(stem) > 200 or stem != stem.lower() or stem.split(".")[0] in _WINDOWS_DEVICES:
            stem = f"{stem[:160]}~{hashlib.sha256(group.encode()).hexdigest()[:16]}"
        if os.sep in stem or (os.altsep and os.altsep in stem):  # validate_name forbids them
            raise ConfigurationError(f"group {group!r} cannot be a file name")
        record = self._directory / f"{stem}.lease.json"
        return _Paths(record, record.with_name(f"{stem}.lease.lock"), Path(f"{record}.tmp"))

    # Worker-thread side: everything here blocks.

    def _transact(self, group: str, step: _Step[T], abandoned: threading.Event) -> T:
        paths = self._paths(group)
        try:
            with FileLock(paths.lock, timeout=self._lock_timeout):
                if abandoned.is_set():
                    raise _Abandoned
                record = self._read(paths.record, group)
                new, result = step(record, time.monotonic())
                if new is not None:
                    write_atomic(paths.record, paths.temp, new.dump(group))
                return result
        except Timeout as exc:
            raise ProviderError(
                f"timed out after {self._lock_timeout:g} s waiting for the lock {str(paths.lock)!r}"
            ) from exc
        except OSError as exc:
            raise ProviderError(f"lease file operation failed for group {group!r}: {exc}") from exc

    @staticmethod
    def _read(path: Path, group: str) -> Record | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return parse(data, group)
        except (ValueError, KeyError, TypeError) as exc:
            raise ProviderError(
                f"corrupt lease record {str(path)!r} ({type(exc).__name__}: {exc}); it is left "
                "untouched: repair or delete it (deleting it resets the group's tokens)"
            ) from exc

    async def _run(self, group: str, step: _Step[T]) -> T:
        abandoned = threading.Event()
        try:
            return await asyncio.to_thread(self._transact, group, step, abandoned)
        except asyncio.CancelledError:
            # A worker that has not taken the lock yet now does nothing; one that has
            # finishes under the lock, so whoever locks next sees its write.
            abandoned.set()
            raise

    # Provider interface.

    @property
    def notify_delay(self) -> float:
        """Followers notice a release at their next poll."""
        return self._poll_interval

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        lease = lease_duration
        meta = dict(metadata)

        def step(record: Record | None, now: float) -> tuple[Record | None, LeaderInfo | None]:
            if record is not None and record.is_live(now):
                return None, None  # held, whoever holds it: a live term is never shared
            token = (record.token if record is not None else 0) + 1
            new = new_lease(token, participant_id, meta, datetime.now(UTC), now + lease)
            return new, new.info()

        return await self._run(group, step)

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        lease = lease_duration
        meta = dict(metadata)

        def step(record: Record | None, now: float) -> tuple[Record | None, bool]:
            if not _holds(record, now, participant_id, token):
                return None, False
            assert record is not None
            assert record.acquired_at is not None
            return new_lease(token, participant_id, meta, record.acquired_at, now + lease), True

        return await self._run(group, step)

    async def release(self, group: str, participant_id: str, token: int) -> None:

        def step(record: Record | None, now: float) -> tuple[Record | None, None]:
            if not _holds(record, now, participant_id, token):
                return None, None
            return Record(token), None  # keep the file and its token: tokens keep rising

        await self._run(group, step)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        record = await self._run(group, _unchanged)
        return record.info() if record is not None else None

    def watch(self, group: str) -> AsyncGenerator[None, None]:
        """Poll the record's `os.stat` every ``poll_interval``; wake at the observed expiry.

        The record is read (under the lock) only when its inode, size or times change,
        and the iterator yields only when the live term (holder, token) or the group's
        last token changed, or when the observed lease is due to expire. A renewal wakes
        nobody; a term that began and ended between two polls does (release keeps the
        token, so "free, then free again" with a higher token means someone led).
        """
        self._paths(group)  # validates the name now, not at the first iteration
        return self._watch(group)

    async def _watch(self, group: str) -> AsyncGenerator[None, None]:
        path = self._paths(group).record
        seen = await asyncio.to_thread(_stat, path)
        live, token = await self._run(group, _observed)
        while True:
            expires = None if live is None else live.expires_at
            wait = self._poll_interval
            if expires is not None:
                wait = min(wait, max(0.0, expires - time.monotonic()))
            await asyncio.sleep(wait)
            if expires is not None and time.monotonic() >= expires:
                live = None
                yield None  # the lease we saw is due to expire: wake the follower now
                continue
            signature = await asyncio.to_thread(_stat, path)
            if signature == seen:
                continue
            seen = signature
            now_live, now_token = await self._run(group, _observed)
            changed = (_term(now_live), now_token) != (_term(live), token)
            live, token = now_live, now_token
            if changed:
                yield None


def _holds(record: Record | None, now: float, participant_id: str, token: int) -> bool:
    return (
        record is not None
        and record.is_live(now)
        and record.holder == participant_id
        and record.token == token
    )


def _unchanged(record: Record | None, now: float) -> tuple[None, Record | None]:
    """A read-only step: return the live record, or None."""
    return None, (record if record is not None and record.is_live(now) else None)


def _observed(record: Record | None, now: float) -> tuple[None, tuple[Record | None, int]]:
    """A read-only step: the live record (or None) and the group's last token (0: none)."""
    return None, (_unchanged(record, now)[1], 0 if record is None else record.token)


def _term(record: Record | None) -> tuple[str | None, int] | None:
    return None if record is None else (record.holder, record.token)


def _stat(path: Path) -> tuple[int, int, int, int] | None:
    """A cheap change signature of the record file (None: no file)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ProviderError(f"cannot stat the lease record {str(path)!r}: {exc}") from exc
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
