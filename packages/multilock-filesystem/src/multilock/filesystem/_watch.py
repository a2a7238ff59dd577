"""How a `FileSystemProvider` learns that a record changed: the OS's file notifications.

One `listen` per provider watches its whole directory and, for each changed record of a
watched group, reads the record and wakes that group's watches through `Notifications`
only when its term (holder and last token) changed: a renewal rewrites the file but
wakes nobody, and "free, then free again with a higher token" (a term that began and
ended between two looks) does wake them.

The changes come from `changes`: on Linux the directory's inotify descriptor, read by the
event loop itself (`multilock.filesystem._inotify`: no thread, about 0.15 ms from a rename
to the listener); elsewhere `watchfiles` (FSEvents on macOS, ReadDirectoryChangesW on
Windows), whose thread hands changes over about 2 ms after they happened.

Where notifications cannot work (a network file system, whose other hosts' writes raise
no local event; a watch failing to start, e.g. at the inotify limits), the provider polls
instead (`multilock.core.provider.poll_watch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Hashable, Iterable
from pathlib import Path

from multilock.core.provider import Notifications, Observed, ProviderError, poll_watch

from . import _inotify

__all__ = [
    "Changes",
    "RECORD_SUFFIX",
    "changes",
    "is_record",
    "listen",
    "network_file_system",
    "poll_record",
    "watchfiles_changes",
]

RECORD_SUFFIX = ".lease.json"
#: How often (ms) watchfiles' thread looks at what the OS reported: a change is handed
#: over about two steps after it happened (it waits for a step that saw nothing new), so
#: 1, its smallest step, hands a rename over about 2 ms after it. One step costs a few
#: microseconds of CPU and takes the GIL. (watchfiles is used where inotify is not.)
STEP_MS = 1
#: The longest (ms) a burst of changes is gathered before it is handed over.
DEBOUNCE_MS = 20
#: After this long (ms) without a change the thread hands over an empty batch: the
#: first batch proves that the directory is watched, and it bounds how long a stop waits.
TIMEOUT_MS = 100

#: The mount table, where a directory's file system type is found.
MOUNTS = "/proc/self/mounts"
#: File systems whose changes made by other hosts raise no local notification.
_NETWORK = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre"}
    | {"gpfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.glusterfs"}
)


def network_file_system(directory: Path) -> str | None:
    """The type of the network file system holding *directory* (Linux only), or None."""
    if sys.platform != "linux":
        return None
    try:
        with open(MOUNTS, encoding="utf-8", errors="replace") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    path = os.path.realpath(directory)
    best, kind = "", ""
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind if kind in _NETWORK else None


def is_record(name: str) -> bool:
    """Whether *name* (a file name or a path) is a lease record's."""
    return name.endswith(RECORD_SUFFIX)


#: A source of changes: yields an empty batch once the directory is watched, then the
#: names of the records that changed (None: anything may have changed).
Changes = Callable[[Path], AsyncGenerator[frozenset[str] | None, None]]


async def watchfiles_changes(directory: Path) -> AsyncGenerator[frozenset[str] | None, None]:
    """The changes of *directory*'s records, through `watchfiles` (its own thread)."""
    import watchfiles  # here: Linux neither needs nor installs it

    def wanted(_change: watchfiles.Change, path: str) -> bool:
        return is_record(path)

    async for batch in watchfiles.awatch(
        directory,
        watch_filter=wanted,
        debounce=DEBOUNCE_MS,
        step=STEP_MS,
        rust_timeout=TIMEOUT_MS,
        yield_on_timeout=True,
        recursive=False,
    ):
        # The first batch (at the first timeout, if not sooner) says the directory is watched.
        yield frozenset(os.path.basename(path) for _, path in batch)


if sys.platform == "linux":

    def changes(directory: Path) -> AsyncGenerator[frozenset[str] | None, None]:
        """The changes of *directory*'s records: its inotify descriptor, in the event loop."""
        return _inotify.changes(directory, is_record)

else:

    def changes(directory: Path) -> AsyncGenerator[frozenset[str] | None, None]:
        """The changes of *directory*'s records, through `watchfiles`."""
        return watchfiles_changes(directory)


async def listen(
    directory: Path,
    group_of: Callable[[str], str | None],
    terms: Callable[[list[str]], Awaitable[dict[str, Hashable]]],
    last: dict[str, Hashable],
    notifications: Notifications,
    source: Changes | None = None,
) -> None:
    """Wake the watches of each group whose record changed term; run until it fails.

    *group_of* maps a record's file name to its group (None: not watched here); *terms*
    reads the term of each group given (something that changes with the holder or the
    last token, and a fresh object when the record cannot be read). *last* holds the
    term each group's watches last saw: they note it when they wake, and so does this.
    *source* gives the changed record names (see `Changes`; default: `changes`).
    """
    subscribed = False
    async with contextlib.aclosing((source or changes)(directory)) as batches:
        async for batch in batches:
            if not subscribed:
                # Anything that changed before now is caught by this: every watch wakes once.
                subscribed = True
                notifications.ready()
                continue
            watched = notifications.groups
            for gone in [g for g in last if g not in watched]:
                del last[gone]  # no watch saw it since: its next change wakes the new ones
            changed = sorted(watched if batch is None else _watched(batch, group_of, watched))
            if not changed:
                continue
            for group, term in (await terms(changed)).items():
                if last.get(group, _UNSEEN) != term:
                    last[group] = term
                    notifications.notify(group)


def _watched(
    names: Iterable[str], group_of: Callable[[str], str | None], watched: frozenset[str]
) -> set[str]:
    groups = (group_of(name) for name in names)
    return {g for g in groups if g is not None and g in watched}


_UNSEEN: Hashable = object()


def poll_record(
    path: Path, read: Callable[[], Awaitable[Observed]], poll_interval: float
) -> AsyncIterator[None]:
    """`poll_watch` of one record: *read* it only when its `os.stat` changed."""
    seen: tuple[int, int, int, int] | None = None  # the file's signature at the last read

    async def changed() -> bool:
        return await asyncio.to_thread(_stat, path) != seen

    async def read_when_stat_changed() -> Observed:
        nonlocal seen
        seen = await asyncio.to_thread(_stat, path)  # before the read: no change missed
        return await read()

    return poll_watch(read_when_stat_changed, poll_interval, changed=changed)


def _stat(path: Path) -> tuple[int, int, int, int] | None:
    """A cheap change signature of the record file (None: no file)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ProviderError(f"cannot stat the lease record {str(path)!r}: {exc}") from exc
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
