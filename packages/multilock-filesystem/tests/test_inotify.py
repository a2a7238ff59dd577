"""The Linux change source: the directory's inotify descriptor, read by the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import struct
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from multilock.filesystem import _inotify, _watch

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="inotify is Linux's")


def event(mask: int, name: bytes = b"") -> bytes:
    """One struct inotify_event: its name NUL-padded as the kernel does."""
    padded = name.ljust((len(name) // 16 + 1) * 16, b"\0") if name else b""
    return struct.pack("iIII", 1, mask, 0, len(padded)) + padded


def test_parse_events_names_overflow_and_gone() -> None:
    data = event(_inotify.IN_MOVED_TO, b"g.lease.json") + event(_inotify.IN_CLOSE_WRITE, b"x")
    assert _inotify.parse_events(data) == ({"g.lease.json", "x"}, False, False)
    assert _inotify.parse_events(event(_inotify.IN_Q_OVERFLOW)) == (set(), True, False)
    gone = event(_inotify.IN_DELETE_SELF) + event(_inotify.IN_IGNORED)
    assert _inotify.parse_events(gone) == (set(), False, True)
    assert _inotify.parse_events(b"") == (set(), False, False)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.asynccontextmanager
async def watching(directory: Path) -> AsyncIterator[AsyncIterator[frozenset[str] | None]]:
    source = _inotify.changes(directory, _watch.is_record)
    async with contextlib.aclosing(source):
        async with asyncio.timeout(5):
            assert await anext(source) == frozenset()  # watched from now on
        yield source


async def next_batch(source: AsyncIterator[frozenset[str] | None]) -> frozenset[str] | None:
    async with asyncio.timeout(5):
        return await anext(source)


def replace(directory: Path, name: str, data: bytes = b"{}") -> None:
    """Write *name* as the provider does: a temp file, then a rename over it."""
    temp = directory / f"{name}.tmp"
    temp.write_bytes(data)
    os.replace(temp, directory / name)


async def test_a_rename_is_delivered_and_temp_files_are_not(tmp_path: Path) -> None:
    async with watching(tmp_path) as source:
        replace(tmp_path, "a.lease.json")
        assert await next_batch(source) == {"a.lease.json"}
        (tmp_path / "notes.txt").write_text("not a record")
        replace(tmp_path, "b.lease.json")
        assert await next_batch(source) == {"b.lease.json"}  # nothing for the others


async def test_a_deletion_and_an_edit_in_place_are_delivered(tmp_path: Path) -> None:
    (tmp_path / "a.lease.json").write_bytes(b"{}")
    async with watching(tmp_path) as source:
        (tmp_path / "a.lease.json").unlink()
        assert await next_batch(source) == {"a.lease.json"}
        (tmp_path / "b.lease.json").write_bytes(b"edited by hand")
        assert await next_batch(source) == {"b.lease.json"}


async def test_no_thread_and_no_descriptor_is_left(tmp_path: Path) -> None:
    # The event loop itself reads the descriptor: no thread hands the changes over.
    threads, descriptors = threading.active_count(), open_descriptors()
    async with watching(tmp_path) as source:
        assert open_descriptors() == descriptors + 1
        replace(tmp_path, "a.lease.json")
        assert await next_batch(source) == {"a.lease.json"}
        assert threading.active_count() == threads
    assert open_descriptors() == descriptors


async def test_a_watch_cancelled_while_waiting_releases_its_descriptor(tmp_path: Path) -> None:
    descriptors = open_descriptors()
    source = _inotify.changes(tmp_path, _watch.is_record)
    assert await anext(source) == frozenset()
    waiting = asyncio.ensure_future(anext(source))
    await asyncio.sleep(0)  # the generator now waits for the descriptor to be readable
    assert open_descriptors() == descriptors + 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert open_descriptors() == descriptors  # removed from the loop and closed


async def test_a_deleted_directory_ends_the_watch(tmp_path: Path) -> None:
    directory = tmp_path / "leases"
    directory.mkdir()
    async with watching(directory) as source:
        shutil.rmtree(directory)
        with pytest.raises(OSError, match="no longer watched"):
            await drain(source)


async def drain(source: AsyncIterator[frozenset[str] | None]) -> None:
    while True:  # the deletions of files come before the end of the directory's watch
        await next_batch(source)


async def test_a_missing_directory_cannot_be_watched(tmp_path: Path) -> None:
    descriptors = open_descriptors()
    source = _inotify.changes(tmp_path / "missing", _watch.is_record)
    with pytest.raises(OSError, match="inotify_add_watch") as caught:
        await anext(source)
    assert caught.value.filename == str(tmp_path / "missing")
    assert open_descriptors() == descriptors
