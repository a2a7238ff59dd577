"""How a `FileSystemProvider` learns that a record changed: the OS's file notifications.

One `listen` per provider watches its whole directory with `watchfiles` (inotify on Linux,
FSEvents on macOS, ReadDirectoryChangesW on Windows) and, for each changed record of a
watched group, reads the record and wakes that group's watches through `Notifications`
only when its term (holder and last token) changed: a renewal rewrites the file but
wakes nobody, and "free, then free again with a higher token" (a term that began and
ended between two looks) does wake them.

Where notifications cannot work (a network file system, whose other hosts' writes raise
no local event; watchfiles failing to start, e.g. at the inotify watch limit), the
provider polls instead (`multilock.core.provider.poll_watch`).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable
from pathlib import Path

import watchfiles

from multilock.core.provider import Notifications, Observed, ProviderError, poll_watch

__all__ = ["RECORD_SUFFIX", "listen", "network_file_system", "poll_record"]

RECORD_SUFFIX = ".lease.json"
#: How often (ms) watchfiles' thread looks at what the OS reported: a change is handed
#: over about two steps after it happened. One step costs a few microseconds of CPU.
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


def _is_record(_change: watchfiles.Change, path: str) -> bool:
    return path.endswith(RECORD_SUFFIX)


async def listen(
    directory: Path,
    group_of: Callable[[str], str | None],
    terms: Callable[[list[str]], Awaitable[dict[str, Hashable]]],
    last: dict[str, Hashable],
    notifications: Notifications,
) -> None:
    """Wake the watches of each group whose record changed term; run until it fails.

    *group_of* maps a record's file name to its group (None: not watched here); *terms*
    reads the term of each group given (something that changes with the holder or the
    last token, and a fresh object when the record cannot be read). *last* holds the
    term each group's watches last saw: they note it when they wake, and so does this.
    """
    subscribed = False
    async for changes in watchfiles.awatch(
        directory,
        watch_filter=_is_record,
        debounce=DEBOUNCE_MS,
        step=STEP_MS,
        rust_timeout=TIMEOUT_MS,
        yield_on_timeout=True,
        recursive=False,
    ):
        if not subscribed:
            # Anything that changed before now is caught by this: every watch wakes once.
            subscribed = True
            notifications.ready()
            continue
        watched = notifications.groups
        for gone in [g for g in last if g not in watched]:
            del last[gone]  # no watch saw it since: its next change wakes the new ones
        changed = sorted(_watched(changes, group_of, watched))
        if not changed:
            continue
        for group, term in (await terms(changed)).items():
            if last.get(group, _UNSEEN) != term:
                last[group] = term
                notifications.notify(group)


def _watched(
    changes: Iterable[tuple[watchfiles.Change, str]],
    group_of: Callable[[str], str | None],
    watched: frozenset[str],
) -> set[str]:
    groups = (group_of(os.path.basename(path)) for _, path in changes)
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
