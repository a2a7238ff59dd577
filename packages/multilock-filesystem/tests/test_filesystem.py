"""FileSystemProvider: the provider contract, and what is specific to lease files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from multilock.core import ConfigurationError, ProviderError, from_url
from multilock.core.provider import Notifications
from multilock.core.testing import PROVIDER_CHECKS, check_provider
from multilock.filesystem import FileSystemProvider, _lock, _provider, _record, _watch

LEASE = 5.0


@pytest.mark.parametrize("check", list(PROVIDER_CHECKS))
async def test_contract(tmp_path: Path, check: str) -> None:
    await check_provider(lambda: FileSystemProvider(tmp_path), lease_duration=0.5, only=check)


def record_path(provider: FileSystemProvider, group: str) -> Path:
    return provider._paths(group).record


async def prepared(provider: FileSystemProvider) -> None:
    """Wait until *provider* has prepared the release records of the terms it began."""
    await asyncio.gather(*provider._preparing)


def read_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_bytes())
    return data


def assert_released(path: Path, token: int) -> None:
    """*path* is group g's record, free, its last token *token*."""
    assert read_json(path) == {"format": 1, "group": "g", "token": token, "holder": None}


async def wait_until(predicate: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.01)


# Files and names.


def test_directory_is_created_and_shown_in_repr(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    provider = FileSystemProvider(target)
    assert target.is_dir()
    assert provider.directory == target
    assert repr(provider) == f"<FileSystemProvider directory={str(target)!r}>"


def test_relative_directory_is_made_absolute(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    provider = FileSystemProvider("leases")
    assert provider.directory == tmp_path / "leases"
    assert provider.directory.is_absolute()


def test_directory_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigurationError, match="lease directory"):
        FileSystemProvider(tmp_path / "file")


@pytest.mark.parametrize("bad", [None, 3, b"/tmp/x", ""])
def test_directory_must_be_a_path(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="directory"):
        FileSystemProvider(bad)


@pytest.mark.parametrize("option", ["poll_interval", "lock_timeout"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), "1"])
def test_bad_durations_rejected(tmp_path: Path, option: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=option):
        FileSystemProvider(tmp_path, **{option: value})


async def test_group_names_map_to_distinct_safe_files(tmp_path: Path) -> None:
    provider = FileSystemProvider(tmp_path)
    # Case-insensitive file systems would merge "Jobs" and "jobs"; long names would
    # overflow NAME_MAX; "con" is a Windows device; ".." must stay inside the directory.
    groups = ["jobs", "Jobs", "JOBS", "x" * 255, "x" * 254 + "y", "con", "..", "."]
    for i, group in enumerate(groups):
        info = await provider.try_acquire(group, f"p{i}", LEASE, {})
        assert info is not None, group
        assert info.token == 1
    paths = {record_path(provider, g) for g in groups}
    assert len(paths) == len(groups)
    assert len({p.name.lower() for p in paths}) == len(groups)  # distinct ignoring case
    for group in groups:
        path = record_path(provider, group)
        assert path.parent == tmp_path
        assert len(path.name) + len(".tmp") <= 255
        assert read_json(path)["group"] == group
    for i, group in enumerate(groups):
        leader = await provider.get_leader(group)
        assert leader is not None
        assert leader.participant_id == f"p{i}"


def test_invalid_group_rejected_by_watch(tmp_path: Path) -> None:
    provider = FileSystemProvider(tmp_path)
    for bad in ["a/b", "..\\x", "", "a b"]:
        with pytest.raises(ConfigurationError):
            provider.watch(bad)
    assert list(tmp_path.iterdir()) == []


# Records.


CORRUPT = {
    "empty": b"",
    "truncated": b'{"format": 1, "group": "g", "token": 3, "hol',
    "not json": b"\x00\x01garbage",
    "not an object": b"[1, 2]",
    "unknown format": b'{"format": 99, "group": "g", "token": 3, "holder": null}',
    "other group": b'{"format": 1, "group": "h", "token": 3, "holder": null}',
    "bad token": b'{"format": 1, "group": "g", "token": "3", "holder": null}',
    "negative token": b'{"format": 1, "group": "g", "token": -1, "holder": null}',
    "missing fields": b'{"format": 1, "group": "g", "token": 3, "holder": "p1"}',
    "bad holder": b'{"format": 1, "group": "g", "token": 3, "holder": "a/b", "metadata": {},'
    b' "acquired_at": "2025-01-01T00:00:00+00:00", "expires_at": 1e12, "boot_id": null,'
    b' "boot_time": 0}',
}


@pytest.mark.parametrize("content", list(CORRUPT.values()), ids=list(CORRUPT))
async def test_corrupt_record_raises_and_is_left_untouched(tmp_path: Path, content: bytes) -> None:
    provider = FileSystemProvider(tmp_path, poll_interval=0.01)
    path = record_path(provider, "g")
    path.write_bytes(content)
    before = os.stat(path)
    calls = [
        provider.try_acquire("g", "p1", LEASE, {}),
        provider.renew("g", "p1", 3, LEASE, {}),
        provider.release("g", "p1", 3),
        provider.get_leader("g"),
        anext(provider.watch("g")),
    ]
    for call in calls:
        with pytest.raises(ProviderError, match="corrupt lease record") as caught:
            await call
        assert caught.value.__cause__ is not None
    after = os.stat(path)
    assert path.read_bytes() == content
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


async def test_half_written_temp_file_is_ignored(tmp_path: Path) -> None:
    provider = FileSystemProvider(tmp_path)
    info = await provider.try_acquire("g", "p1", LEASE, {"k": "v"})
    assert info is not None
    temp = provider._paths("g").temp
    assert temp.name == "g.lease.json.tmp"
    assert not temp.exists()  # renamed over the record
    # A writer killed mid-write leaves a torn temp file behind.
    temp.write_bytes(b'{"format": 1, "group": "g", "token": 99, "hold')
    leader = await provider.get_leader("g")
    assert leader == info
    assert await provider.renew("g", "p1", info.token, LEASE, {"k": "w"})
    assert not temp.exists()  # the next write truncated and reused it
    assert read_json(record_path(provider, "g"))["token"] == info.token
    await provider.release("g", "p1", info.token)
    again = await provider.try_acquire("g", "p2", LEASE, {})
    assert again is not None
    assert again.token == info.token + 1


async def test_live_term_refuses_its_own_participant_id_and_keeps_the_file(
    tmp_path: Path,
) -> None:
    first, second = FileSystemProvider(tmp_path), FileSystemProvider(tmp_path)
    info = await first.try_acquire("g", "p1", LEASE, {"instance": "a"})
    assert info is not None
    path = record_path(first, "g")
    content, before = path.read_bytes(), os.stat(path)
    # Two processes configured with one participant id, and the holder's own repeat.
    assert await second.try_acquire("g", "p1", LEASE, {"instance": "b"}) is None
    assert await first.try_acquire("g", "p1", LEASE, {"instance": "c"}) is None
    after = os.stat(path)
    assert path.read_bytes() == content  # a refused attempt writes nothing
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert await second.get_leader("g") == info
    assert await first.renew("g", "p1", info.token, LEASE, {"instance": "a"})


async def test_token_survives_release_and_a_new_provider(tmp_path: Path) -> None:
    first = FileSystemProvider(tmp_path)
    info = await first.try_acquire("g", "p1", LEASE, {})
    assert info is not None
    await first.release("g", "p1", info.token)
    record = read_json(record_path(first, "g"))
    assert record == {"format": 1, "group": "g", "token": info.token, "holder": None}
    await first.aclose()

    second = FileSystemProvider(tmp_path)
    assert await second.get_leader("g") is None
    taken = await second.try_acquire("g", "p1", LEASE, {})
    assert taken is not None
    assert taken.token == info.token + 1


async def test_acquire_is_stamped_with_this_boot(tmp_path: Path) -> None:
    provider = FileSystemProvider(tmp_path)
    await provider.try_acquire("g", "p1", LEASE, {})
    record = read_json(record_path(provider, "g"))
    assert record["boot_id"] == _record.BOOT_ID
    if sys.platform == "linux":
        assert record["boot_id"] == linux_boot_id()
    assert abs(record["boot_time"] - (time.time() - time.monotonic())) < 1
    assert 0 < record["expires_at"] - time.monotonic() <= LEASE


def linux_boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def rewrite(path: Path, **changes: Any) -> None:
    record = read_json(path)
    record.update(changes)
    path.write_text(json.dumps(record))


async def test_record_from_another_boot_id_has_expired(tmp_path: Path) -> None:
    provider = FileSystemProvider(tmp_path)
    info = await provider.try_acquire("g", "p1", 3600, {})
    assert info is not None
    assert await provider.try_acquire("g", "p2", LEASE, {}) is None
    if _record.BOOT_ID is None:
        pytest.skip("this kernel gives no boot id")
    rewrite(record_path(provider, "g"), boot_id=str(uuid.uuid4()))
    assert await provider.get_leader("g") is None
    assert not await provider.renew("g", "p1", info.token, LEASE, {})
    taken = await provider.try_acquire("g", "p2", LEASE, {})
    assert taken is not None
    assert taken.token == info.token + 1


async def test_without_boot_id_the_boot_time_estimate_decides(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(_record, "BOOT_ID", None)
    provider = FileSystemProvider(tmp_path)
    info = await provider.try_acquire("g", "p1", 3600, {})
    assert info is not None
    path = record_path(provider, "g")
    assert read_json(path)["boot_id"] is None
    # Within the tolerance (clock slew, rounding): the same boot, still held.
    rewrite(path, boot_time=read_json(path)["boot_time"] + 60)
    assert await provider.get_leader("g") == info
    # A boot long before: the monotonic clock restarted since, the lease is void.
    rewrite(path, boot_time=read_json(path)["boot_time"] - 86_400)
    assert await provider.get_leader("g") is None
    taken = await provider.try_acquire("g", "p2", LEASE, {})
    assert taken is not None
    assert taken.token == info.token + 1


# The release record, prepared while the term runs.


@pytest.fixture
def fsyncs(monkeypatch: Any) -> list[int]:
    """Every fsync a lease file's write makes, by file descriptor."""
    seen: list[int] = []
    original = _record._fsync

    def counting_fsync(fd: int) -> None:
        seen.append(fd)
        original(fd)

    monkeypatch.setattr(_record, "_fsync", counting_fsync)
    return seen


async def test_a_prepared_release_is_one_rename(tmp_path: Path, fsyncs: list[int]) -> None:
    provider = FileSystemProvider(tmp_path)
    info = await provider.try_acquire("g", "p1", LEASE, {"k": "v"})
    assert info is not None
    await prepared(provider)
    paths = provider._paths("g")
    assert paths.free.name == "g.lease.free"
    assert paths.free.read_bytes() == _record.Record(info.token).dump("g")
    assert len(fsyncs) == 3  # the acquire's record and directory, the prepared file
    prepared_inode = os.stat(paths.free).st_ino
    fsyncs.clear()
    await provider.release("g", "p1", info.token)
    assert fsyncs == []  # no write: the prepared file became the record
    assert os.stat(paths.record).st_ino == prepared_inode
    assert not paths.free.exists()
    assert_released(paths.record, info.token)
    again = await provider.try_acquire("g", "p2", LEASE, {})
    assert again is not None
    assert again.token == info.token + 1
    await provider.aclose()


async def test_a_release_before_its_record_is_prepared_writes_it(
    tmp_path: Path, fsyncs: list[int], monkeypatch: Any
) -> None:
    monkeypatch.setattr(_provider, "PREPARE_AFTER", 3600.0)
    provider = FileSystemProvider(tmp_path)
    paths = provider._paths("g")
    earlier = await provider.try_acquire("g", "p0", LEASE, {})
    assert earlier is not None
    await provider.release("g", "p0", earlier.token)
    # A prepared file left by that earlier term (say its provider crashed, then the
    # group was released by hand).
    paths.free.write_bytes(_record.Record(earlier.token).dump("g"))
    first = await provider.try_acquire("g", "p1", LEASE, {})
    assert first is not None
    assert first.token == earlier.token + 1
    assert len(provider._preparing) == 2  # both waiting for PREPARE_AFTER
    fsyncs.clear()
    await provider.release("g", "p1", first.token)
    assert len(fsyncs) == 1  # the record written and fsynced (no directory fsync)
    assert_released(paths.record, first.token)
    # Late, or for a term that has ended: nothing is prepared.
    provider._prepare_release("g", "p1", first.token, threading.Event())
    assert paths.free.read_bytes() == _record.Record(earlier.token).dump("g")
    await provider.aclose()
    assert not provider._preparing  # cancelled by aclose


async def test_a_release_whose_prepared_file_is_gone_writes_its_record(
    tmp_path: Path, fsyncs: list[int]
) -> None:
    provider = FileSystemProvider(tmp_path)
    info = await provider.try_acquire("g", "p1", LEASE, {})
    assert info is not None
    await prepared(provider)
    paths = provider._paths("g")
    paths.free.unlink()
    fsyncs.clear()
    await provider.release("g", "p1", info.token)
    assert len(fsyncs) == 1
    assert_released(paths.record, info.token)
    await provider.aclose()


async def test_a_term_that_ended_never_renames_its_prepared_file(
    tmp_path: Path, monkeypatch: Any
) -> None:
    first, second = FileSystemProvider(tmp_path), FileSystemProvider(tmp_path)
    paths = first._paths("g")
    info = await first.try_acquire("g", "p1", 0.3, {})
    assert info is not None
    await prepared(first)
    assert paths.free.exists()
    expires_at = read_json(paths.record)["expires_at"]
    await wait_until(lambda: time.monotonic() > expires_at, 5, "the first term to expire")
    monkeypatch.setattr(_provider, "PREPARE_AFTER", 3600.0)
    taken = await second.try_acquire("g", "p2", LEASE, {})
    assert taken is not None
    assert taken.token == info.token + 1
    record = paths.record.read_bytes()
    await first.release("g", "p1", info.token)  # too late: its term has ended
    assert paths.record.read_bytes() == record
    assert paths.free.exists()  # the first term's, never renamed
    await second.release("g", "p2", taken.token)  # not prepared yet: written
    assert_released(paths.record, taken.token)
    # The first provider's next term does not take the old file for its own.
    again = await first.try_acquire("g", "p1", LEASE, {})
    assert again is not None
    await first.release("g", "p1", again.token)
    assert_released(paths.record, again.token)
    await first.aclose()
    await second.aclose()


class _Clock:
    """A stand-in for the provider module's `time`: `monotonic` moves only when told."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize("seed", range(12))
async def test_prepared_releases_under_a_seeded_mix_of_terms(
    tmp_path: Path, monkeypatch: Any, seed: int
) -> None:
    """Three providers (as three processes) acquire, renew, prepare, release, lose the
    prepared file and let leases expire in a seeded order, on a clock moved by hand; the
    record must always be what a plain model of one lease says, and every release leave
    exactly its own term's token."""
    import random

    clock = _Clock()
    monkeypatch.setattr(_provider, "time", clock)
    monkeypatch.setattr(_provider, "PREPARE_AFTER", 3600.0)  # prepared here, by hand
    rng = random.Random(seed)
    providers = [FileSystemProvider(tmp_path) for _ in range(3)]
    paths = providers[0]._paths("g")
    tokens = [0, 0, 0]  # each participant's last term
    token, holder, expires, released = 0, -1, 0.0, True  # the model of the lease
    renames = 0
    for _ in range(400):
        live = not released and clock.now < expires
        op = rng.choice(["acquire", "renew", "prepare", "release", "release", "lose", "wait"])
        i = holder if live and rng.random() < 0.5 else rng.randrange(3)  # the holder, often
        if op == "acquire":
            info = await providers[i].try_acquire("g", f"p{i}", 1.0, {})
            if live:
                assert info is None
            else:
                assert info is not None
                assert info.token == token + 1
                token, holder, expires, released = token + 1, i, clock.now + 1.0, False
                tokens[i] = token
        elif op == "renew":
            ok = await providers[i].renew("g", f"p{i}", tokens[i], 1.0, {})
            assert ok == (live and (holder, token) == (i, tokens[i]))
            if ok:
                expires = clock.now + 1.0
        elif op == "prepare":
            providers[i]._prepare_release("g", f"p{i}", tokens[i], threading.Event())
        elif op == "release":
            before = os.stat(paths.free).st_ino if paths.free.exists() else None
            await providers[i].release("g", f"p{i}", tokens[i])
            if live and (holder, token) == (i, tokens[i]):
                released = True
                renames += before is not None and os.stat(paths.record).st_ino == before
        elif op == "lose":
            paths.free.unlink(missing_ok=True)  # removed by hand: the release writes instead
        else:
            clock.now += rng.choice([0.1, 0.5, 1.0])
        if token:
            record = read_json(paths.record)
            assert record["token"] == token
            if released:
                assert_released(paths.record, token)
            else:
                assert record["holder"] == f"p{holder}"
    assert renames > 0  # the prepared path was taken, not only the fallbacks
    for provider in providers:
        await provider.aclose()


# The lock.


# What another process runs to hold a group's lock: this package's own lock, and the
# `filelock` lock that earlier versions took (they must exclude each other).
HOLDERS = {
    "flock": "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('locked', flush=True)\n"
    "time.sleep(120)\n",
    "filelock": "import sys, time, filelock\n"
    "with filelock.FileLock(sys.argv[1]):\n"
    "    print('locked', flush=True)\n"
    "    time.sleep(120)\n",
}


@pytest.mark.parametrize("holder_kind", list(HOLDERS))
async def test_lock_held_elsewhere_times_out_as_provider_error(
    tmp_path: Path, holder_kind: str
) -> None:
    if holder_kind == "filelock":
        pytest.importorskip("filelock")
    provider = FileSystemProvider(tmp_path, lock_timeout=0.3)
    lock_path = provider._paths("g").lock
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOLDERS[holder_kind],
        str(lock_path),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        async with asyncio.timeout(30):
            assert await holder.stdout.readline() == b"locked\n"
        started = time.monotonic()
        with pytest.raises(ProviderError, match="timed out") as caught:
            await provider.try_acquire("g", "p1", LEASE, {})
        assert isinstance(caught.value.__cause__, _lock.LockTimeout)
        assert 0.25 <= time.monotonic() - started < 3
        with pytest.raises(ProviderError, match="timed out"):
            await provider.get_leader("g")
    finally:
        holder.kill()
        await holder.wait()
    # The holder died: the kernel dropped its lock.
    assert await provider.try_acquire("g", "p1", LEASE, {}) is not None


async def test_lock_held_by_another_thread_times_out(tmp_path: Path) -> None:
    provider = FileSystemProvider(tmp_path, lock_timeout=0.2)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with _lock.exclusive(provider._paths("g").lock, 5):
            held.set()
            done.wait(10)

    holder = asyncio.ensure_future(asyncio.to_thread(hold))
    try:
        assert await asyncio.to_thread(held.wait, 10)
        with pytest.raises(ProviderError, match="timed out"):
            await provider.release("g", "p1", 1)
    finally:
        done.set()
        await holder
    assert await provider.get_leader("g") is None


def test_lock_excludes_the_threads_of_one_process(tmp_path: Path) -> None:
    # One descriptor per acquisition: flock would let two threads sharing one through.
    path, counter = tmp_path / "g.lease.lock", tmp_path / "counter"
    counter.write_text("0")

    def bump() -> None:
        for _ in range(20):
            with _lock.exclusive(path, 10):
                value = int(counter.read_text())
                time.sleep(0.0005)  # a real section: the others try meanwhile
                counter.write_text(str(value + 1))

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert counter.read_text() == "80"


@pytest.mark.skipif(sys.platform == "win32", reason="flock: POSIX only")
def test_lock_retries_soon_then_every_millisecond(tmp_path: Path, monkeypatch: Any) -> None:
    import fcntl

    path = tmp_path / "g.lease.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file description holds it
    waits: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(_lock.time, "sleep", sleep)
    try:
        with pytest.raises(_lock.LockTimeout), _lock.exclusive(path, 0.03):
            pytest.fail("locked a file another holds")
    finally:
        os.close(fd)
    assert waits[:5] == pytest.approx([0.0001, 0.0002, 0.0004, 0.0008, 0.001])
    assert max(waits) == pytest.approx(0.001)
    with _lock.exclusive(path, 0.03):  # closing the holder's descriptor freed it
        pass


@pytest.mark.skipif(sys.platform == "win32", reason="symlinks and flock: POSIX")
async def test_a_symlinked_lock_file_is_refused(tmp_path: Path) -> None:
    provider = FileSystemProvider(tmp_path)
    elsewhere = tmp_path / "elsewhere.lock"
    elsewhere.touch()
    provider._paths("g").lock.symlink_to(elsewhere)
    with pytest.raises(ProviderError, match="lease file operation failed"):
        await provider.try_acquire("g", "p1", LEASE, {})


# Watching: file notifications, and polling where they cannot work.

NOTIFY = pytest.mark.parametrize("notify", [True, False], ids=["notify", "poll"])


@pytest.fixture
def reads(monkeypatch: Any) -> list[str]:
    """Every group whose record file any provider reads, in order."""
    seen: list[str] = []
    original = FileSystemProvider._read

    def counting_read(path: Path, group: str) -> Any:
        seen.append(group)
        return original(path, group)

    monkeypatch.setattr(FileSystemProvider, "_read", staticmethod(counting_read))
    return seen


@contextlib.asynccontextmanager
async def wakes(watch: AsyncIterator[None]) -> AsyncIterator[asyncio.Event]:
    """Follow *watch* in a task; the event is set at each wake-up, the first one awaited."""
    woke = asyncio.Event()

    async def follow() -> None:
        async for _ in watch:
            woke.set()

    task = asyncio.ensure_future(follow())
    try:
        async with asyncio.timeout(5):
            await woke.wait()  # a watch yields once it is set up
        woke.clear()
        yield woke
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        aclose = getattr(watch, "aclose", None)
        if aclose is not None:
            await aclose()


async def woken(woke: asyncio.Event, within: float, what: str) -> None:
    try:
        async with asyncio.timeout(within):
            await woke.wait()
    except TimeoutError:
        raise AssertionError(f"the watch did not wake within {within} s {what}") from None
    woke.clear()


@NOTIFY
async def test_watch_sleeps_through_renewals_and_wakes_at_expiry(
    tmp_path: Path, reads: list[str], notify: bool
) -> None:
    leader = FileSystemProvider(tmp_path)
    follower = FileSystemProvider(tmp_path, poll_interval=0.02, notify=notify)
    info = await leader.try_acquire("g", "p1", 0.6, {})
    assert info is not None
    await prepared(leader)  # its read of the record is done
    watch = follower.watch("g")
    assert isinstance(watch, AsyncIterator)
    async with wakes(watch) as woke:
        idle_reads = len(reads)
        await asyncio.sleep(0.2)  # 10 polls of an unchanged file: stat only, no read
        assert len(reads) == idle_reads
        for _ in range(3):
            assert await leader.renew("g", "p1", info.token, 0.6, {})
            await asyncio.sleep(0.15)
        assert not woke.is_set()  # renewals change no term
        expires = read_json(record_path(leader, "g"))["expires_at"]
        await woken(woke, 2, "at expiry")
        assert expires <= time.monotonic() < expires + 0.25
        assert await follower.get_leader("g") is None
    await leader.aclose()
    await follower.aclose()


@NOTIFY
async def test_watch_wakes_on_acquire_and_release(tmp_path: Path, notify: bool) -> None:
    provider = FileSystemProvider(tmp_path, poll_interval=0.02, notify=notify)
    assert provider.notify_delay == (0.0 if notify else 0.02)
    async with wakes(provider.watch("g")) as woke:
        info = await provider.try_acquire("g", "p1", LEASE, {})
        assert info is not None
        await woken(woke, 2, "after an acquire")
        await provider.release("g", "p1", info.token)
        await woken(woke, 2, "after a release")
    await provider.aclose()


@NOTIFY
async def test_watch_wakes_for_a_term_that_began_and_ended_between_two_polls(
    tmp_path: Path, notify: bool
) -> None:
    # Free before and free after, but someone led in between: a follower whose hold-off
    # ends when another participant leads must hear of it.
    provider = FileSystemProvider(tmp_path, poll_interval=1.0, notify=notify)
    first = await provider.try_acquire("g", "p1", LEASE, {})
    assert first is not None
    await provider.release("g", "p1", first.token)
    async with wakes(provider.watch("g")) as woke:
        # The watch has seen the group free; the whole term then fits in one poll.
        brief = await provider.try_acquire("g", "p2", LEASE, {})
        assert brief is not None
        await provider.release("g", "p2", brief.token)
        await woken(woke, 3, "after a brief term")
    await provider.aclose()


async def test_a_release_by_another_provider_wakes_a_watch_long_before_a_poll(
    tmp_path: Path,
) -> None:
    # Two providers on one directory stand for two processes: nothing in memory is
    # shared, and with a 30 s poll interval only a file notification explains the wake.
    leader = FileSystemProvider(tmp_path)
    follower = FileSystemProvider(tmp_path, poll_interval=30)
    assert follower.notify_delay == 0.0
    info = await leader.try_acquire("g", "p1", 60, {})
    assert info is not None
    async with wakes(follower.watch("g")) as woke:
        await asyncio.sleep(0.05)
        assert not woke.is_set()
        released = time.monotonic()
        await leader.release("g", "p1", info.token)
        await woken(woke, 2, "after another provider's release")
        assert time.monotonic() - released < 2 < 30
        assert await follower.get_leader("g") is None
        taken = await leader.try_acquire("g", "p2", 60, {})
        assert taken is not None
        await woken(woke, 2, "after another provider's acquire")
    await leader.aclose()
    await follower.aclose()


async def test_one_directory_watcher_serves_every_group(tmp_path: Path, monkeypatch: Any) -> None:
    started: list[Path] = []
    real = _watch.changes

    def counting(directory: Path) -> AsyncGenerator[frozenset[str] | None, None]:
        started.append(directory)
        return real(directory)

    monkeypatch.setattr(_watch, "changes", counting)
    leader, follower = FileSystemProvider(tmp_path), FileSystemProvider(tmp_path)
    groups = [f"g{i}" for i in range(20)]
    async with contextlib.AsyncExitStack() as stack:
        woke = {g: await stack.enter_async_context(wakes(follower.watch(g))) for g in groups}
        assert started == [tmp_path]  # one watcher, for all twenty groups
        info = await leader.try_acquire("g7", "p1", LEASE, {})
        assert info is not None
        await woken(woke["g7"], 2, "after an acquire")
        await asyncio.sleep(0.1)
        assert [g for g in groups if woke[g].is_set()] == []  # the others slept on
    await leader.aclose()
    await follower.aclose()


async def test_watch_polls_when_the_directory_cannot_be_watched(
    tmp_path: Path, monkeypatch: Any
) -> None:
    async def refuse(_directory: Path) -> AsyncGenerator[frozenset[str] | None, None]:
        raise OSError("OS file watch limit reached")
        yield frozenset()  # an async generator, as the sources are

    monkeypatch.setattr(_watch, "changes", refuse)
    provider = FileSystemProvider(tmp_path, poll_interval=0.05)
    assert provider.notify_delay == 0.0
    with pytest.raises(ProviderError, match="watch limit") as caught:
        await anext(provider.watch("g"))
    assert isinstance(caught.value.__cause__, OSError)
    # The election watches again later: now it polls, and says so.
    assert provider.notify_delay == 0.05
    async with wakes(provider.watch("g")) as woke:
        info = await provider.try_acquire("g", "p1", LEASE, {})
        assert info is not None
        await woken(woke, 2, "after an acquire, polling")
        await provider.release("g", "p1", info.token)
        await woken(woke, 2, "after a release, polling")
    await provider.aclose()


async def test_the_watchfiles_source_wakes_on_acquire_and_release(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # The source of macOS and Windows; it runs on Linux too, so it is tested here.
    pytest.importorskip("watchfiles")
    monkeypatch.setattr(_watch, "changes", _watch.watchfiles_changes)
    leader, follower = FileSystemProvider(tmp_path), FileSystemProvider(tmp_path)
    async with wakes(follower.watch("g")) as woke:
        info = await leader.try_acquire("g", "p1", LEASE, {})
        assert info is not None
        await woken(woke, 2, "after an acquire")
        assert await leader.renew("g", "p1", info.token, LEASE, {})
        await asyncio.sleep(0.1)
        assert not woke.is_set()  # a renewal changes no term
        await leader.release("g", "p1", info.token)
        await woken(woke, 2, "after a release")
    await leader.aclose()
    await follower.aclose()


async def test_an_overflowed_queue_rereads_every_watched_group(tmp_path: Path) -> None:
    # None from the source: events were lost, so every watched group is read again.
    batches: asyncio.Queue[frozenset[str] | None] = asyncio.Queue()

    async def source(_directory: Path) -> AsyncGenerator[frozenset[str] | None, None]:
        while True:
            yield await batches.get()

    asked: list[list[str]] = []

    async def terms(groups: list[str]) -> dict[str, Any]:
        asked.append(groups)
        return dict.fromkeys(groups, ("p1", 3))

    listener = Notifications(lambda _n: asyncio.sleep(3600), name="test")
    woke = {g: asyncio.Event() for g in ("a", "b", "c")}

    async def follow(group: str) -> None:
        async for _ in listener.watch(group):
            woke[group].set()

    followers = [asyncio.ensure_future(follow(g)) for g in ("a", "b")]
    await asyncio.sleep(0)
    names = {"a.lease.json": "a", "b.lease.json": "b", "c.lease.json": "c"}
    last: dict[str, Any] = {}
    task = asyncio.ensure_future(
        _watch.listen(tmp_path, names.get, terms, last, listener, source=source)
    )
    try:
        batches.put_nowait(frozenset())  # subscribed
        batches.put_nowait(frozenset({"b.lease.json", "c.lease.json", "x.lease.json"}))
        batches.put_nowait(None)
        async with asyncio.timeout(5):
            while len(asked) < 2:
                await asyncio.sleep(0.01)
        assert asked == [["b"], ["a", "b"]]  # c and x are watched by nobody here
        assert last == {"a": ("p1", 3), "b": ("p1", 3)}
    finally:
        for each in (task, *followers):
            each.cancel()
        await asyncio.gather(task, *followers, return_exceptions=True)


async def test_the_listener_reads_a_cached_record_in_the_event_loop(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # A record that just changed is in the page cache: read at once, no thread hop.
    provider = FileSystemProvider(tmp_path)
    info = await provider.try_acquire("g", "p1", LEASE, {})
    assert info is not None
    if _record.read_cached(record_path(provider, "g")) is None:
        pytest.skip("this system cannot read without waiting (no RWF_NOWAIT)")
    (tmp_path / "bad.lease.json").write_bytes(b"{not json")
    hops: list[object] = []
    real_to_thread = asyncio.to_thread

    async def to_thread(fn: Any, *args: Any) -> Any:
        hops.append(fn)
        return await real_to_thread(fn, *args)

    monkeypatch.setattr(_provider.asyncio, "to_thread", to_thread)
    terms = await provider._read_terms(["g", "bad", "none"])
    assert hops == []
    assert terms["g"] == ("p1", info.token)
    assert terms["none"] == (None, 0)
    assert type(terms["bad"]) is object  # unreadable: its watches wake and fail there
    assert "bad" not in provider._ends
    # Not in the page cache (or no way to tell): the read goes to a worker thread.
    monkeypatch.setattr(_provider, "read_cached", lambda _path: None)
    assert await provider._read_terms(["g", "none"]) == {
        "g": ("p1", info.token),
        "none": (None, 0),
    }
    assert len(hops) == 1
    await provider.aclose()


def test_write_atomic_and_read_file_round_trip(tmp_path: Path) -> None:
    path, temp = tmp_path / "g.lease.json", tmp_path / "g.lease.json.tmp"
    temp.write_bytes(b"x" * 300_000)  # a longer temp file a crashed writer left behind
    data = os.urandom(200_000)  # several reads' worth
    _record.write_atomic(path, temp, data)
    assert not temp.exists()
    assert _record.read_file(path) == data == path.read_bytes()
    _record.write_atomic(path, temp, b"{}\n", durable=False)
    assert _record.read_file(path) == b"{}\n"  # bytes as given: no newline translation


@pytest.mark.skipif(sys.platform != "linux", reason="RWF_NOWAIT is Linux's")
def test_read_cached_reads_all_or_nothing(tmp_path: Path) -> None:
    path = tmp_path / "g.lease.json"
    data = os.urandom(3 * 4096 + 17)  # more than one chunk
    path.write_bytes(data)
    assert _record.read_cached(path) == data
    with pytest.raises(FileNotFoundError):
        _record.read_cached(tmp_path / "missing.lease.json")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages, which the kernel may drop
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    got = _record.read_cached(path)
    if got is not None:
        pytest.skip("this file system kept the pages (tmpfs?)")
    assert path.read_bytes() == data  # a plain read brings them back
    assert _record.read_cached(path) == data


def test_a_network_file_system_is_polled(tmp_path: Path, monkeypatch: Any) -> None:
    if sys.platform != "linux":
        pytest.skip("mount types are read from /proc on Linux")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/export {tmp_path} nfs4 rw 0 0\n")
    monkeypatch.setattr(_watch, "MOUNTS", str(mounts))
    assert _watch.network_file_system(tmp_path / "leases") == "nfs4"
    assert FileSystemProvider(tmp_path / "leases", poll_interval=0.3).notify_delay == 0.3
    assert _watch.network_file_system(tmp_path.parent) is None


def test_notify_can_be_turned_off(tmp_path: Path) -> None:
    provider = from_url(f"file://{tmp_path}?notify=false&poll_interval=0.25")
    assert isinstance(provider, FileSystemProvider)
    assert provider.notify_delay == 0.25
    assert from_url(f"file://{tmp_path}?notify=true").notify_delay == 0.0
    with pytest.raises(ConfigurationError, match="notify"):
        FileSystemProvider(tmp_path, notify="no")  # type: ignore[arg-type]


# URLs.


def test_from_url_absolute_path(tmp_path: Path) -> None:
    provider = from_url(f"file://{tmp_path}/leases")
    assert isinstance(provider, FileSystemProvider)
    assert provider.directory == tmp_path / "leases"
    assert (tmp_path / "leases").is_dir()
    local = from_url(f"file://localhost{tmp_path}")
    assert isinstance(local, FileSystemProvider)
    assert local.directory == tmp_path


def test_from_url_options(tmp_path: Path) -> None:
    provider = from_url(f"file://{tmp_path}?poll_interval=0.1&lock_timeout=2")
    assert isinstance(provider, FileSystemProvider)
    assert provider._poll_interval == 0.1
    assert provider._lock_timeout == 2.0
    keyword = from_url(f"file://{tmp_path}", poll_interval=0.25)
    assert isinstance(keyword, FileSystemProvider)
    assert keyword._poll_interval == 0.25


def test_from_url_percent_encoding(tmp_path: Path) -> None:
    provider = from_url(f"file://{tmp_path}/with%20space")
    assert isinstance(provider, FileSystemProvider)
    assert provider.directory == tmp_path / "with space"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file://relative/dir", "three slashes"),
        ("file://./leases", "three slashes"),
        ("file:relative/dir", "absolute"),
        ("file://", "absolute"),
        ("file:///tmp/x?color=blue", "unknown option"),
        ("file:///tmp/x?poll_interval=soon", "poll_interval"),
        ("file:///tmp/x?poll_interval=0", "poll_interval"),
        ("file:///tmp/x?notify=maybe", "notify"),
    ],
)
def test_from_url_rejects(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        from_url(url)


def test_from_url_rejects_an_option_given_twice() -> None:
    with pytest.raises(ConfigurationError, match="both"):
        from_url("file:///tmp/x?lock_timeout=1", lock_timeout=2)


async def test_aclose_cancelled_while_a_release_is_prepared_can_be_called_again(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(_provider, "PREPARE_AFTER", 0.0)
    preparing, go_on = threading.Event(), threading.Event()
    prepare = FileSystemProvider._prepare_release

    def slow_prepare(self: FileSystemProvider, *args: Any) -> None:
        preparing.set()
        go_on.wait(10)
        prepare(self, *args)

    monkeypatch.setattr(FileSystemProvider, "_prepare_release", slow_prepare)
    provider = FileSystemProvider(tmp_path)
    info = await provider.try_acquire("g", "p1", LEASE, {})
    assert info is not None
    assert await asyncio.to_thread(preparing.wait, 10)  # its thread is running
    closing = asyncio.ensure_future(provider.aclose())
    await asyncio.sleep(0)  # it waits for the cancelled preparation
    closing.cancel()
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await provider.aclose()  # again, to the end
    assert not provider._preparing
    with pytest.raises(ProviderError):
        async for _ in provider.watch("g"):
            pass
    await provider.release("g", "p1", info.token)  # the record is still consistent
    assert_released(provider._paths("g").record, info.token)
