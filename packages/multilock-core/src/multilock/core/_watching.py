"""The two ways a provider's ``watch`` wakes followers: a shared notification feed, or polling.

Both wake a follower exactly when the lease it last saw is due to end (plus `EXPIRY_SLACK`,
so that the store agrees it ended), and never for a mere renewal.

- `Notifications`: one listener per provider (one pub/sub connection, one LISTEN connection,
  one watch stream) fans the store's notifications out to every watch of every group.
- `poll_watch`: for stores that cannot notify, read every ``poll_interval``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable

import attrs

from ._errors import ProviderError

__all__ = ["EXPIRY_SLACK", "Notifications", "Observed", "poll_watch"]

log = logging.getLogger(__name__)

#: How long after a lease's observed end a watch wakes, so the store judges it ended too.
EXPIRY_SLACK = 0.005


# --------------------------------------------------------------------------- polling
@attrs.frozen
class Observed:
    """One read of a group by a polling watch.

    ``holder`` is whatever identifies the live term (participant and token, say; None when
    the group is free): a change wakes the followers. ``version`` changes with every write
    (an ETag, a modification time), and ``expires_in`` is how long the lease just read has
    left, counted from when this watch first saw that version: a renewal writes a new
    version, so the expiry moves; a lease whose version has not changed by then has ended.
    """

    holder: Hashable
    version: Hashable = None
    expires_in: float | None = None


async def poll_watch(
    read: Callable[[], Awaitable[Observed]],
    poll_interval: float,
    *,
    changed: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncIterator[None]:
    """Yield at the first read, then whenever the holder changes or the seen lease ends.

    *read* is called every *poll_interval* seconds, and just after the lease it last
    reported is due. *changed*, if given, is a cheaper probe (a file's ``stat``): when it
    says nothing changed, the read is skipped. While a lease stays expired in the store
    under the same version (nobody took it yet), every poll yields again, so a follower
    whose store judged the end a little later than this watch is not left asleep.
    """
    clock = asyncio.get_running_loop().time
    last: Hashable = _FIRST
    version: Hashable = _FIRST
    due: float | None = None
    ended = False
    while True:
        expired = due is not None and clock() >= due
        if last is _FIRST or expired or changed is None or await changed():
            seen = await read()
            now = clock()
            if seen.version != version:
                version, ended = seen.version, False
                due = None if seen.expires_in is None else now + seen.expires_in
            if due is not None and now >= due:
                ended, due = True, None
            holder = _ENDED if ended else seen.holder
            if holder is _ENDED or holder != last:
                last = holder
                yield None
        now = clock()
        wake_at = (
            now + poll_interval if due is None else min(now + poll_interval, due + EXPIRY_SLACK)
        )
        await asyncio.sleep(max(0.0, wake_at - now))


#: Sentinels: nothing read yet; the lease seen has ended but the store still shows it.
_FIRST: Hashable = object()
_ENDED: Hashable = object()


# --------------------------------------------------------------------------- notifications
class _Watcher:
    __slots__ = ("failed", "group", "wake")

    def __init__(self, group: str) -> None:
        self.group = group
        self.wake = asyncio.Event()
        self.failed: BaseException | None = None


#: Seconds `Notifications.aclose` waits for a cancelled listener to end.
CLOSE_TIMEOUT = 5.0


class Notifications:
    """Fan one listener's notifications out to the watches of many groups.

    A provider keeps one, built with its *listen* coroutine, and returns
    ``notifications.watch(group)`` from its ``watch``. The listener runs only while at
    least one watch is open: the first watch starts it, the last one to close stops it (so
    an idle provider holds no listening connection). It opens one connection to the store,
    subscribes to every group at once (a channel pattern, one LISTEN channel, a key-prefix
    watch), calls `ready` once subscribed (again after a reconnect: every watch then wakes,
    since notifications may have been missed), and `notify` for each notification. When
    it raises, every open watch raises `ProviderError` (the core then polls and watches
    again later, which starts a new listener).

    *expires_in*, if given, reads how long the group's lease has left (None: no lease);
    each watch then also wakes when the lease it saw is due to end and is not renewed.
    """

    def __init__(
        self,
        listen: Callable[[Notifications], Awaitable[None]],
        *,
        name: str,
        expires_in: Callable[[str], Awaitable[float | None]] | None = None,
    ) -> None:
        self._listen = listen
        self._name = name
        self._expires_in = expires_in
        self._watchers: dict[str, set[_Watcher]] = {}
        self._count = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()
        self._reading: dict[str, asyncio.Future[float | None]] = {}
        self._ready = False
        self._closed = False

    def __repr__(self) -> str:
        return f"<Notifications {self._name}: {self._count} watches, listening={self.listening}>"

    @property
    def listening(self) -> bool:
        """Whether the listener is subscribed now."""
        return self._ready and self._task is not None and not self._task.done()

    @property
    def groups(self) -> frozenset[str]:
        """The groups with an open watch."""
        return frozenset(self._watchers)

    def ready(self) -> None:
        """Tell every watch the listener is (again) subscribed: each wakes once."""
        self._ready = True
        for watchers in self._watchers.values():
            for watcher in watchers:
                watcher.wake.set()

    def notify(self, group: str) -> None:
        """Wake every watch of *group* (unknown groups are ignored)."""
        for watcher in self._watchers.get(group, ()):
            watcher.wake.set()

    def watch(self, group: str) -> AsyncIterator[None]:
        """Yield once subscribed, then on every notification for *group* and at expiry."""
        if self._closed:
            raise ProviderError(f"{self._name} is closed")
        return self._watch(group)

    async def _watch(self, group: str) -> AsyncIterator[None]:
        watcher = _Watcher(group)
        self._watchers.setdefault(group, set()).add(watcher)
        self._count += 1
        if self._task is None or self._task.done():
            self._ready = False
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"multilock-listen-{self._name}"
            )
        elif self._ready:
            watcher.wake.set()  # subscribed already: the first yield comes at once
        try:
            due: float | None = None
            while True:
                if due is None:
                    await watcher.wake.wait()
                else:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout_at(due):
                            await watcher.wake.wait()
                failed = watcher.failed
                if isinstance(failed, ProviderError):
                    raise ProviderError(str(failed)) from failed.__cause__
                if failed is not None:
                    raise ProviderError(f"{self._name}: the listener broke") from failed
                if watcher.wake.is_set():
                    watcher.wake.clear()
                    yield None  # first: the follower's round does not wait for the read
                    left = await self._left(group)
                else:  # the timer: the lease this watch saw is due to end
                    left = await self._left(group)
                    if left is None:
                        yield None
                    # Otherwise it was renewed: sleep on until the new end.
                due = None if left is None else asyncio.get_running_loop().time() + left
        finally:
            watchers = self._watchers.get(group)
            if watchers is not None:
                watchers.discard(watcher)
                if not watchers:
                    del self._watchers[group]
            self._count -= 1
            if self._count == 0 and self._task is not None:
                task, self._task = self._task, None
                task.cancel()  # it closes its connection as it ends; aclose() waits for it
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)

    async def _left(self, group: str) -> float | None:
        """Seconds until *group*'s lease ends plus `EXPIRY_SLACK` (None: no lease).

        One read per group at a time: the watches woken together share it.
        """
        if self._expires_in is None:
            return None
        reading = self._reading.get(group)
        if reading is None:
            reading = asyncio.ensure_future(self._expires_in(group))
            self._reading[group] = reading
            reading.add_done_callback(functools.partial(self._read, group))
        left = await asyncio.shield(reading)
        return None if left is None else max(0.0, left) + EXPIRY_SLACK

    def _read(self, group: str, reading: asyncio.Future[float | None]) -> None:
        if self._reading.get(group) is reading:
            del self._reading[group]
        if not reading.cancelled():
            reading.exception()  # retrieved, even when every watch waiting for it is gone

    async def _run(self) -> None:
        try:
            await self._listen(self)
            raise ProviderError(f"{self._name}: the listener stopped")
        except Exception as exc:
            self._fail(exc)
        finally:
            self._ready = False

    def _fail(self, exc: BaseException) -> None:
        log.debug("%s: the listener broke: %r", self._name, exc)
        for watchers in self._watchers.values():
            for watcher in watchers:
                watcher.failed = exc
                watcher.wake.set()

    async def aclose(self) -> None:
        """Stop the listener; open watches raise `ProviderError`. Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        tasks = {*self._stopping, *([task] if task is not None else [])}
        for each in tasks:
            each.cancel()
        if tasks:
            # Bounded: a driver blocked in a read that ignores the cancellation must not
            # hold the provider's close for ever (its task settles, or not, on its own).
            _, pending = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT)
            if pending:
                log.warning(
                    "%s: the listener did not stop within %g s of its cancellation; "
                    "closing without it", self._name, CLOSE_TIMEOUT,
                )  # fmt: skip
        self._fail(ProviderError(f"{self._name} is closed"))
