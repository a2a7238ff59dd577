"""Linux: the directory's inotify descriptor, read by the event loop itself.

`changes` opens one inotify instance (``inotify_init1`` through `ctypes`: the C library
is always there on Linux), watches the directory, and registers the descriptor with
``loop.add_reader``: the kernel's event wakes the loop directly, so a rename is handed to
the listener about 0.15 ms after it happened, with no thread and no timer. (watchfiles, used
elsewhere, checks its queue from a thread every ``step`` milliseconds and hands a batch over
only once a step saw nothing new, about 2 ms after the change at its smallest step, and wakes
that thread, and takes the GIL, every millisecond while it watches.)

Only what a record's writers do is watched: a rename into the directory (how every
record is written), a rename out of it or a deletion (someone removed a record), and the
close of a file written in place (an edit by hand). The temp files' own events are
filtered out by name.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import struct
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

__all__ = ["changes", "parse_events"]

IN_CLOSE_WRITE = 0x0000_0008
IN_MOVED_FROM = 0x0000_0040
IN_MOVED_TO = 0x0000_0080
IN_DELETE = 0x0000_0200
IN_DELETE_SELF = 0x0000_0400
IN_MOVE_SELF = 0x0000_0800
IN_UNMOUNT = 0x0000_2000
IN_Q_OVERFLOW = 0x0000_4000
IN_IGNORED = 0x0000_8000
IN_ONLYDIR = 0x0100_0000
IN_EXCL_UNLINK = 0x0400_0000

#: The events that say a record may have changed.
MASK = IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE
#: The events that say the directory itself is gone, moved or unmounted: its watch is over.
GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_IGNORED

#: struct inotify_event: int wd; uint32_t mask, cookie, len; char name[len].
_HEADER = struct.Struct("iIII")
#: How much one read takes (a batch of events; the loop reads again until none is left).
_READ_SIZE = 64 * 1024

_libc: ctypes.CDLL | None = None


def _c_library() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)  # the process's C library: no search
    return _libc


def _check(result: int, what: str, directory: Path) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}", str(directory))
    return result


def _open(directory: Path) -> int:
    """An inotify descriptor (non-blocking, close-on-exec) watching *directory*."""
    libc = _c_library()
    # IN_NONBLOCK and IN_CLOEXEC are defined as O_NONBLOCK and O_CLOEXEC.
    fd = _check(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC), "inotify_init1", directory)
    try:
        mask = ctypes.c_uint32(MASK | IN_ONLYDIR | IN_EXCL_UNLINK)
        _check(
            libc.inotify_add_watch(fd, os.fsencode(directory), mask),
            "inotify_add_watch",
            directory,
        )
    except BaseException:
        os.close(fd)
        raise
    return fd


def parse_events(data: bytes) -> tuple[set[str], bool, bool]:
    """The file names in a read of inotify events, whether the queue overflowed, and
    whether the directory's watch is over."""
    names: set[str] = set()
    overflow = gone = False
    offset, end = 0, len(data)
    while offset + _HEADER.size <= end:
        _wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
        offset += _HEADER.size
        name = data[offset : offset + length].rstrip(b"\0")
        offset += length
        if mask & IN_Q_OVERFLOW:
            overflow = True
        if mask & GONE:
            gone = True
        if name:
            names.add(os.fsdecode(name))
    return names, overflow, gone


async def changes(
    directory: Path, wanted: Callable[[str], bool]
) -> AsyncGenerator[frozenset[str] | None, None]:
    """Yield an empty set once *directory* is watched, then the *wanted* names changed.

    None means the kernel's queue overflowed: anything may have changed. Raises `OSError`
    when the directory cannot be watched (the inotify limits, a missing directory) or
    stops being watched (deleted, moved, unmounted).
    """
    loop = asyncio.get_running_loop()
    fd = _open(directory)
    pending: set[str] = set()
    overflowed = False
    failure: OSError | None = None
    readable = asyncio.Event()

    def on_readable() -> None:
        nonlocal overflowed, failure
        try:
            while True:
                names, overflow, gone = parse_events(os.read(fd, _READ_SIZE))
                pending.update(name for name in names if wanted(name))
                overflowed |= overflow
                if gone:
                    failure = OSError(f"the directory {str(directory)!r} is no longer watched")
        except BlockingIOError:
            pass  # drained
        except OSError as exc:
            failure = exc
        if failure is not None:
            loop.remove_reader(fd)
        readable.set()

    loop.add_reader(fd, on_readable)
    try:
        yield frozenset()
        while True:
            await readable.wait()
            readable.clear()
            if failure is not None:
                raise failure
            if overflowed:
                overflowed = False
                pending.clear()
                yield None
            elif pending:
                batch = frozenset(pending)
                pending.clear()
                yield batch
    finally:
        loop.remove_reader(fd)
        os.close(fd)
