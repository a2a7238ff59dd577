"""`FileSystemProvider`: leases in files, for the processes of one machine.

Store: one JSON record per group, ``<group>.lease.json``, next to its lock file
``<group>.lease.lock`` (names that are long, contain capitals or are Windows device
names get a hash suffix, so case-insensitive file systems never merge two groups).
Every operation takes its group's lock (``flock``, see `_lock`), reads the record,
decides and, if it changes anything, writes ``<group>.lease.json.tmp``, fsyncs it, renames
it over the record with `os.replace` and, when the token rose, fsyncs the directory.
Readers therefore see the old record or the new one, never a mix, and a crash mid-write
leaves only the temp file behind. A release is usually a single rename: shortly after a
term begins (``PREPARE_AFTER``), its provider writes and fsyncs that term's release record
to ``<group>.lease.free`` (under the lock, while the term holds the record), so the
handoff to the next leader pays no write and no fsync; a release before then, or one
whose prepared file is gone, writes as above.

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
- `watch` wakes followers on a new term or a release, and exactly when the lease they
  saw is due to expire; never on a renewal. One directory watcher per provider (inotify
  read by the event loop on Linux; `watchfiles`' FSEvents or ReadDirectoryChangesW
  elsewhere) serves the watches of every group; where it cannot work (a network file
  system, ``notify=False``, the watcher failing to start) `watch` polls the record's
  `os.stat` every ``poll_interval`` instead, and reads the record only when that changed.

Failure modes: a crashed holder's lease stays until it expires (the kernel frees its
lock at once). A record that cannot be parsed (corrupt, truncated, edited by hand) makes
every call on its group raise `ProviderError`; it is never taken over or overwritten.
A lock not taken within ``lock_timeout`` raises `ProviderError`. Deleting the directory
or a record resets that group's tokens. Network file systems are out of scope: their
locks and rename semantics vary and their hosts do not share a monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterator,
    Mapping,
)
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast

from multilock.core.provider import (
    ConfigurationError,
    LeaderInfo,
    Notifications,
    Observed,
    Provider,
    ProviderError,
    to_seconds,
)

from ._lock import LockTimeout, exclusive
from ._record import (
    Record,
    new_lease,
    parse,
    read_cached,
    read_file,
    write_atomic,
    write_file,
)
from ._url import parse_url
from ._watch import RECORD_SUFFIX, listen, network_file_system, poll_record

__all__ = ["FileSystemProvider"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_WINDOWS_DEVICES = frozenset(
    {"con", "prn", "aux", "nul"} | {f"{p}{i}" for p in ("com", "lpt") for i in range(10)}
)


class _Abandoned(Exception):
    """The caller was cancelled before this worker took the lock."""


#: Seconds into a term when its provider prepares the term's release record: late
#: enough to stay off the acquire's path (the successor's ACQUIRED, the former
#: leader's wake-up), early enough for nearly every real term.
PREPARE_AFTER = 0.01


class _Paths(NamedTuple):
    record: Path
    lock: Path
    temp: Path
    #: The release record of the current term, written ahead (see `PREPARE_AFTER`).
    free: Path


# What an operation decides, given the record (None: no file yet) and the monotonic now:
# the record to write (None: write nothing) and the result to return.
_Step = Callable[[Record | None, float], tuple[Record | None, T]]


class FileSystemProvider(Provider):
    """Keep each group's lease in a file under *directory* (created if missing).

    Correct across the processes of one machine; not across machines (see the module
    docstring). ``notify`` (default True) lets `watch` wake on the OS's file
    notifications; ``poll_interval`` is how often `watch` checks the record instead when
    it cannot (``notify=False``, a network file system); ``lock_timeout`` bounds the wait
    for a group's file lock.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        poll_interval: float | timedelta = 0.5,
        lock_timeout: float | timedelta = 5.0,
        notify: bool = True,
    ) -> None:
        path = os.fspath(directory) if isinstance(directory, str | os.PathLike) else None
        if not isinstance(path, str) or not path:
            raise ConfigurationError("directory must be a non-empty str or os.PathLike[str]")
        if not isinstance(notify, bool):
            raise ConfigurationError(f"notify must be True or False, not {notify!r}")
        self._poll_interval = to_seconds(poll_interval, "poll_interval")
        self._lock_timeout = to_seconds(lock_timeout, "lock_timeout")
        self._directory = Path(os.path.abspath(path))
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot use {str(self._directory)!r} as the lease directory: {exc}"
            ) from exc
        self._notify = notify
        if notify and (kind := network_file_system(self._directory)) is not None:
            log.info("%s is on %s, which cannot notify: watches poll", self._directory, kind)
            self._notify = False
        #: Record file name -> group, for every group watched: the listener's map.
        self._groups: dict[str, str] = {}
        #: Group -> the term (holder, last token) its watches were last woken for.
        self._terms: dict[str, Hashable] = {}
        #: Group -> when its lease ends (monotonic; None: free), as the listener last read.
        self._ends: dict[str, float | None] = {}
        self._notifications = Notifications(
            self._listen, name=f"filesystem {self._directory}", expires_in=self._expires_in
        )
        #: Group -> the token whose release record this provider last wrote to
        #: ``<group>.lease.free``; changed only under the group's lock.
        self._prepared: dict[str, int] = {}
        self._preparing: set[asyncio.Task[None]] = set()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> FileSystemProvider:
        """Build from ``file:///absolute/path[?poll_interval=0.5&lock_timeout=5&notify=true]``."""
        path, options = parse_url(url, kwargs)
        return cls(path, **options)

    @property
    def directory(self) -> Path:
        """The directory holding the lease records."""
        return self._directory

    def __repr__(self) -> str:
        return f"<FileSystemProvider directory={str(self._directory)!r}>"

    def _paths(self, group: str) -> _Paths:
        stem = group
        if len(stem) > 200 or stem != stem.lower() or stem.split(".")[0] in _WINDOWS_DEVICES:
            stem = f"{stem[:160]}~{hashlib.sha256(group.encode()).hexdigest()[:16]}"
        if os.sep in stem or (os.altsep and os.altsep in stem):  # valid names have none
            raise ConfigurationError(f"group {group!r} cannot be a file name")
        record = self._directory / f"{stem}{RECORD_SUFFIX}"
        return _Paths(
            record,
            record.with_name(f"{stem}.lease.lock"),
            Path(f"{record}.tmp"),
            record.with_name(f"{stem}.lease.free"),
        )

    # Worker-thread side: everything here blocks.

    def _transact(self, group: str, step: _Step[T], abandoned: threading.Event) -> T:
        with self._locked(group, abandoned) as paths:
            record = self._read(paths.record, group)
            new, result = step(record, time.monotonic())
            if new is None:
                return result
            raised = record is None or new.token != record.token
            if raised:
                self._prepared.pop(group, None)  # a new term: nothing is prepared for it
            elif new.holder is None and self._prepared.pop(group, None) == new.token:
                with contextlib.suppress(FileNotFoundError):  # removed: write it below
                    os.replace(paths.free, paths.record)  # the term's own release record
                    return result
            write_atomic(paths.record, paths.temp, new.dump(group), durable=raised)
            return result

    def _prepare_release(
        self, group: str, holder: str, token: int, abandoned: threading.Event
    ) -> None:
        """While *holder*'s term *token* holds the record, write and fsync its release
        record to ``<group>.lease.free`` for `release` to rename."""
        with self._locked(group, abandoned) as paths:
            record = self._read(paths.record, group)
            if record is not None and _holds(record, time.monotonic(), holder, token):
                write_file(paths.free, Record(token).dump(group))
                self._prepared[group] = token

    @contextlib.contextmanager
    def _locked(self, group: str, abandoned: threading.Event) -> Iterator[_Paths]:
        """Hold *group*'s lock, mapping failures to `ProviderError`."""
        paths = self._paths(group)
        try:
            with exclusive(paths.lock, self._lock_timeout):
                if abandoned.is_set():
                    raise _Abandoned
                yield paths
        except LockTimeout as exc:
            raise ProviderError(
                f"timed out after {self._lock_timeout:g} s waiting for the lock {str(paths.lock)!r}"
            ) from exc
        except OSError as exc:
            raise ProviderError(f"lease file operation failed for group {group!r}: {exc}") from exc

    @staticmethod
    def _read(path: Path, group: str) -> Record | None:
        try:
            data = read_file(path)
        except FileNotFoundError:
            return None
        return FileSystemProvider._parse(data, path, group)

    @staticmethod
    def _parse(data: bytes, path: Path, group: str) -> Record:
        try:
            return parse(data, group)
        except (ValueError, KeyError, TypeError) as exc:
            raise ProviderError(
                f"corrupt lease record {str(path)!r} ({type(exc).__name__}: {exc}); it is left "
                "untouched: repair or delete it (deleting it resets the group's tokens)"
            ) from exc

    async def _run(self, group: str, step: _Step[T]) -> T:
        return await self._in_thread(functools.partial(self._transact, group, step))

    @staticmethod
    async def _in_thread(work: Callable[[threading.Event], T]) -> T:
        abandoned = threading.Event()
        try:
            return await asyncio.to_thread(work, abandoned)
        except asyncio.CancelledError:
            # A worker that has not taken the lock yet now does nothing; one that has
            # finishes under the lock, so whoever locks next sees its write.
            abandoned.set()
            raise

    # Provider interface.

    @property
    def notify_delay(self) -> float:
        """0 while file notifications wake the followers; else the poll interval."""
        return 0.0 if self._notify else self._poll_interval

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        def step(record: Record | None, now: float) -> tuple[Record | None, LeaderInfo | None]:
            if record is not None and record.is_live(now):
                return None, None  # held, whoever holds it: a live term is never shared
            token = (record.token if record is not None else 0) + 1
            expires_at = now + lease_duration
            new = new_lease(token, participant_id, dict(metadata), datetime.now(UTC), expires_at)
            return new, new.info()

        info = await self._run(group, step)
        if info is not None:
            task = asyncio.create_task(self._prepare(group, participant_id, info.token))
            self._preparing.add(task)
            task.add_done_callback(self._preparing.discard)
        return info

    async def _prepare(self, group: str, holder: str, token: int) -> None:
        await asyncio.sleep(PREPARE_AFTER)
        work = functools.partial(self._prepare_release, group, holder, token)
        try:
            await self._in_thread(work)
        except (ProviderError, _Abandoned) as exc:  # then the release writes its record
            log.debug("could not prepare the release of %r: %s", group, exc)

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        def step(record: Record | None, now: float) -> tuple[Record | None, bool]:
            if record is None or not _holds(record, now, participant_id, token):
                return None, False
            assert record.acquired_at is not None
            expires_at = now + lease_duration
            return new_lease(
                token, participant_id, dict(metadata), record.acquired_at, expires_at
            ), True

        return await self._run(group, step)

    async def release(self, group: str, participant_id: str, token: int) -> None:
        def step(record: Record | None, now: float) -> tuple[Record | None, None]:
            if record is None or not _holds(record, now, participant_id, token):
                return None, None
            return Record(token), None  # keep the file and its token: tokens keep rising

        await self._run(group, step)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        record = await self._run(group, _live)
        return record.info() if record is not None else None

    def watch(self, group: str) -> AsyncIterator[None]:
        """Wake on a new term or a release, and when the lease seen is due to expire.

        With notifications, the provider's one directory watcher wakes the group's
        watches; without, the record's `os.stat` is polled every ``poll_interval`` and
        the record read only when that changed. Either way a renewal wakes nobody, and a
        term that began and ended unseen does (release keeps the token, so "free, then
        free again" with a higher token means someone led).
        """
        paths = self._paths(group)
        if not self._notify:
            return poll_record(paths.record, self._observe(group), self._poll_interval)
        self._groups[paths.record.name] = group
        return self._notified(group)

    async def aclose(self) -> None:
        """Stop the directory watcher; open watches raise `ProviderError`. Idempotent."""
        for task in list(self._preparing):
            task.cancel()
        await asyncio.gather(*self._preparing, return_exceptions=True)
        await self._notifications.aclose()

    # Watching: reads without the lock, since a rename replaces a record whole (POSIX).

    def _peek(self, group: str) -> tuple[Record | None, float]:
        """The record (read without its lock on POSIX) and the monotonic time of the read."""
        if os.name != "posix":
            return self._transact(group, lambda record, now: (None, (record, now)), _NEVER)
        try:
            return self._read(self._paths(group).record, group), time.monotonic()
        except OSError as exc:
            raise ProviderError(f"cannot read the lease record of {group!r}: {exc}") from exc

    def _peek_cached(self, group: str) -> tuple[Record | None, float] | None:
        """`_peek` without waiting for a disk, fit for the event loop: None when the
        record is not all in the page cache, or where that cannot be known."""
        if os.name != "posix":
            return None
        path = self._paths(group).record
        try:
            data = read_cached(path)
        except FileNotFoundError:
            return None, time.monotonic()
        except OSError as exc:
            raise ProviderError(f"cannot read the lease record of {group!r}: {exc}") from exc
        if data is None:
            return None
        return self._parse(data, path, group), time.monotonic()

    def _note(self, group: str, peeked: tuple[Record | None, float] | None = None) -> Hashable:
        """Read *group*'s term (unless *peeked*) and note when its lease ends, for the watches."""
        record, now = self._peek(group) if peeked is None else peeked
        live = record is not None and record.is_live(now)
        self._ends[group] = record.expires_at if live and record is not None else None
        return _term(record, now)

    async def _notified(self, group: str) -> AsyncIterator[None]:
        if group not in self._notifications.groups:  # else the listener's notes are newer
            self._terms[group] = await asyncio.to_thread(self._note, group)
        watch = cast(AsyncGenerator[None, None], self._notifications.watch(group))
        async with contextlib.aclosing(watch):
            async for _ in watch:
                yield None

    async def _listen(self, notifications: Notifications) -> None:
        try:
            await listen(
                self._directory, self._groups.get, self._read_terms, self._terms, notifications
            )
        except (OSError, RuntimeError) as exc:  # the directory cannot be watched
            log.warning("cannot watch %s, polling from now on: %r", self._directory, exc)
            self._notify = False
            raise ProviderError(f"cannot watch {str(self._directory)!r}: {exc}") from exc

    async def _read_terms(self, groups: list[str]) -> dict[str, Hashable]:
        """The listener's reads: in the event loop when the page cache holds the record (a
        record that just changed nearly always is: no thread hop between a change and the
        wake-up), in a worker thread otherwise."""
        terms: dict[str, Hashable] = {}
        uncached: list[str] = []
        for group in groups:
            try:
                peeked = self._peek_cached(group)
            except ProviderError:
                terms[group] = self._unreadable(group)
                continue
            if peeked is None:
                uncached.append(group)
            else:
                terms[group] = self._note(group, peeked)
        if uncached:
            terms.update(await asyncio.to_thread(self._notes, uncached))
        return terms

    def _notes(self, groups: list[str]) -> dict[str, Hashable]:
        terms: dict[str, Hashable] = {}
        for group in groups:
            try:
                terms[group] = self._note(group)
            except ProviderError:
                terms[group] = self._unreadable(group)
        return terms

    def _unreadable(self, group: str) -> Hashable:
        self._ends.pop(group, None)
        return object()  # a term never seen: its watches wake and fail there

    async def _expires_in(self, group: str) -> float | None:
        # The listener notes every change of a watched record before it wakes anyone, so
        # its note is current; a note older than a renewal only wakes a watch early.
        if group not in self._ends:
            await asyncio.to_thread(self._note, group)
        end = self._ends.get(group)
        left = None if end is None else end - time.monotonic()
        return left if left is not None and left > 0 else None  # None: the lease has ended

    def _observe(self, group: str) -> Callable[[], Awaitable[Observed]]:
        async def observe() -> Observed:
            return _observed(*await asyncio.to_thread(self._peek, group))

        return observe


_NEVER = threading.Event()  # a read is never abandoned: it changes nothing


def _holds(record: Record, now: float, participant_id: str, token: int) -> bool:
    return record.is_live(now) and (record.holder, record.token) == (participant_id, token)


def _live(record: Record | None, now: float) -> tuple[None, Record | None]:
    """A read-only step: the live record, or None."""
    return None, (record if record is not None and record.is_live(now) else None)


def _term(record: Record | None, now: float) -> tuple[str | None, int]:
    """The live holder (or None) and the group's last token (0: none)."""
    if record is None:
        return (None, 0)
    return (record.holder if record.is_live(now) else None, record.token)


def _observed(record: Record | None, now: float) -> Observed:
    """The term, the version and the time left, for `poll_watch`."""
    live = _live(record, now)[1]
    return Observed(
        _term(record, now),
        version=None if record is None else (record.token, record.holder, record.expires_at),
        expires_in=None if live is None else live.expires_at - now,
    )
