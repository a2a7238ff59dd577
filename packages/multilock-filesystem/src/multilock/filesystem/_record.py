"""The lease record of one group: its JSON format, its boot identity and its atomic write.

A record is a small JSON object::

    {"format": 1, "group": "reports", "token": 7, "holder": "web-1-4242-ab12cd34",
     "metadata": {}, "acquired_at": "2025-01-01T00:00:00+00:00",
     "expires_at": 81234.5, "boot_id": "5f0c...", "boot_time": 1735689000.123}

A free group keeps its file with ``"holder": null`` so its token never goes back.
``expires_at`` is on `time.monotonic`, shared by every process of one boot; since that
clock restarts at boot, ``boot_id`` (Linux ``/proc/sys/kernel/random/boot_id``, macOS
``kern.bootsessionuuid``) and ``boot_time`` (the estimate ``time.time() - time.monotonic()``)
say which boot wrote it, and a record of another boot has expired. Without a kernel boot
id, two estimates within `BOOT_TIME_TOLERANCE` seconds are one boot.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs

from multilock.core import LeaderInfo, validate_metadata, validate_name

__all__ = [
    "BOOT_TIME_TOLERANCE",
    "Record",
    "new_lease",
    "parse",
    "read_cached",
    "read_file",
    "write_atomic",
    "write_file",
]

#: Seconds by which two boot-time estimates may differ and still name the same boot.
#: Larger is safer against wall-clock steps; it only delays taking over a record
#: written in a boot that lasted less than this before a reboot.
BOOT_TIME_TOLERANCE = 300.0
FORMAT = 1

if sys.platform == "linux":

    def _read_boot_id() -> str | None:
        try:
            return Path("/proc/sys/kernel/random/boot_id").read_text("ascii").strip() or None
        except (OSError, ValueError):
            return None

elif sys.platform == "darwin":

    def _read_boot_id() -> str | None:
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            buf, size = ctypes.create_string_buffer(64), ctypes.c_size_t(64)
            if libc.sysctlbyname(b"kern.bootsessionuuid", buf, ctypes.byref(size), None, 0):
                return None
            return buf.value.decode("ascii").strip() or None
        except (OSError, ValueError, AttributeError):
            return None

else:

    def _read_boot_id() -> str | None:
        return None


#: The kernel's identifier of this boot (None where there is none); a process never
#: outlives its boot, so it is read once.
BOOT_ID = _read_boot_id()


def boot_time() -> float:
    """Estimate when this machine booted, in wall-clock seconds."""
    return round(time.time() - time.monotonic(), 3)


@attrs.frozen
class Record:
    """A parsed record; ``holder is None`` means free."""

    token: int
    holder: str | None = None
    metadata: dict[str, str] = attrs.field(factory=dict)
    acquired_at: datetime | None = None
    expires_at: float = 0.0  # on time.monotonic() of the boot named below
    boot_id: str | None = None
    boot_time: float = 0.0

    def is_live(self, now: float) -> bool:
        """Held, of this boot, and not expired at *now* (`time.monotonic`)."""
        if self.holder is None or self.expires_at <= now:
            return False
        if BOOT_ID is not None and self.boot_id is not None:
            return self.boot_id == BOOT_ID
        return abs(self.boot_time - boot_time()) <= BOOT_TIME_TOLERANCE

    def info(self) -> LeaderInfo:
        assert self.holder is not None
        assert self.acquired_at is not None
        return LeaderInfo(
            participant_id=self.holder,
            token=self.token,
            metadata=self.metadata,
            acquired_at=self.acquired_at,
        )

    def dump(self, group: str) -> bytes:
        data: dict[str, Any] = {"format": FORMAT, "group": group, "token": self.token}
        data["holder"] = self.holder
        if self.holder is not None:
            assert self.acquired_at is not None
            data.update(
                metadata=self.metadata,
                acquired_at=self.acquired_at.isoformat(),
                expires_at=self.expires_at,
                boot_id=self.boot_id,
                boot_time=self.boot_time,
            )
        return json.dumps(data, indent=1).encode("utf-8")


def new_lease(
    token: int, holder: str, metadata: dict[str, str], acquired_at: datetime, expires_at: float
) -> Record:
    """A held record stamped with this boot."""
    return Record(token, holder, metadata, acquired_at, expires_at, BOOT_ID, boot_time())


def _number(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{field} is not a number")
    return float(value)


def parse(data: bytes, group: str) -> Record:
    """Parse strictly; raise ValueError, KeyError or TypeError for anything else."""
    raw = json.loads(data.decode("utf-8"))
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"not a format {FORMAT} lease record")
    if raw.get("group") != group:
        raise ValueError(f"it belongs to the group {raw.get('group')!r}")
    token = raw["token"]
    if type(token) is not int or token < 0:
        raise ValueError("token is not a non-negative integer")
    holder = raw["holder"]
    if holder is None:
        return Record(token)
    boot_id = raw["boot_id"]
    if boot_id is not None and not isinstance(boot_id, str):
        raise ValueError("boot_id is not a string")
    acquired_at = datetime.fromisoformat(raw["acquired_at"])
    if acquired_at.tzinfo is None:
        raise ValueError("acquired_at has no time zone")
    return Record(
        token=token,
        holder=validate_name(holder, "holder"),
        metadata=validate_metadata(raw["metadata"]),
        acquired_at=acquired_at,
        expires_at=_number(raw["expires_at"], "expires_at"),
        boot_id=boot_id,
        boot_time=_number(raw["boot_time"], "boot_time"),
    )


#: Read without waiting for a disk: fails with EAGAIN when the page cache lacks the data
#: (Linux 4.14+; None where the system has no such read).
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None) if hasattr(os, "preadv") else None
_CHUNK = 4096
_READ_SIZE = 64 * 1024
#: For `os.open`: not inherited by child processes; binary on Windows (no newline
#: translation).
_OPEN_FLAGS = (
    getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOINHERIT", 0) | getattr(os, "O_BINARY", 0)
)


def read_cached(path: Path) -> bytes | None:
    """*path*'s content if the page cache holds all of it, read without waiting for a disk.

    None when some of it is not cached (or where reads cannot be told not to wait: not
    Linux, or a file system without ``RWF_NOWAIT``); then read it in a worker thread.
    A record was just written when it is read this way, so it is nearly always cached;
    a read of a few hundred cached bytes takes microseconds, fit for the event loop.
    Raises `FileNotFoundError` when there is no file, `OSError` when it cannot be read.
    """
    if _NOWAIT is None:
        return None
    fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    try:
        data = bytearray()
        chunk = bytearray(_CHUNK)
        while True:
            try:
                size = os.preadv(fd, [chunk], len(data), _NOWAIT)
            except BlockingIOError:
                return None  # not all in the page cache: reading it would wait for the disk
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    return None  # this file system or kernel cannot read without waiting
                raise
            if size == 0:
                return bytes(data)
            data += chunk[:size]
    finally:
        os.close(fd)


def _fsync(fd: int) -> None:
    if sys.platform == "darwin":  # plain fsync does not flush the drive's cache on macOS
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
        except OSError:
            pass
        else:
            return
    os.fsync(fd)


def read_file(path: Path) -> bytes:
    """*path*'s content: `Path.read_bytes` in four system calls instead of nine (each one
    gives the GIL up and takes it back, behind the event loop, in a worker thread)."""
    fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    try:
        chunks = []
        while chunk := os.read(fd, _READ_SIZE):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Write *data* to *path* (created or truncated) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN_FLAGS, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        _fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, temp: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace *path* by *data*: write and fsync *temp*, rename it, fsync the directory.

    The fsync of *temp* keeps the record whole through a power cut. The directory's
    fsync makes the rename itself durable: needed when the write raises the token (a
    power cut must not undo a token), not for a renewal or a release (*durable* False):
    undone, either leaves the term's own record, which expired with its boot.
    The caller holds the group's lock, so *temp* has one writer at a time; a temp file
    left by a writer that crashed is truncated here and never read. Plain `os` calls,
    not `open`: seven or eight system calls instead of ten or eleven.
    """
    write_file(temp, data)
    os.replace(temp, path)
    if durable and os.name == "posix":  # make the rename durable: tokens never go back
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            _fsync(fd)
        finally:
            os.close(fd)
