"""What the blocking facades of `multilock.core.sync` share.

`Facade` holds the blocking portal to the loop thread, a provider given or built from a
URL, and the one close; `Lifetime` adds the ``with`` block that is the object's life
(`multilock.core.sync.LeaderElection`, `multilock.core.sync.Shards`). The functions run
user code in threads for the loop: `in_worker_thread` calls a function of a term in a
daemon thread of its own and waits for it even through cancellation (`until_settled`),
and `Escaped` carries a ``SystemExit`` of that code back unharmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self, TypeVar

from ._calls import describe_callable, is_async_callable
from ._errors import LeadershipLost, MultilockError
from ._portal import AsyncCall, BlockingPortal, LoopFactory
from ._provider import Provider
from ._types import Leadership
from ._url import from_url, redact_url

__all__ = [
    "Escaped",
    "Facade",
    "Lifetime",
    "build",
    "ended_by_loss",
    "in_worker_thread",
    "on_loop",
    "require_plain",
    "settle",
    "until_settled",
]

T = TypeVar("T")


# ---------------------------------------------------------------------- work in threads
class Escaped(Exception):
    """Carry a BaseException (SystemExit...) of user code through the loop unharmed."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(repr(exc))
        self.exc = exc


def settle(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


async def until_settled(done: asyncio.Future[T], leadership: Leadership) -> T:
    """Wait for work running in a thread of *leadership*'s term, which cancellation cannot stop.

    When cancelled (the term ended, or the caller gave up), keep waiting until the thread
    is done, through any further cancellation, so that ``stop()``/``resign()`` release the
    lease only after the work has stopped. A term can be cancelled twice: an interrupted
    ``run_while_leader`` cancels it, then ``stop()`` does. The wait ends, and the
    cancellation goes on, when the term's deadline passes (renewals move it while the term
    holds): the lease may expire from then on anyway.
    """
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        clock = asyncio.get_running_loop().time  # the election's clock, as in _election.py
        # Not ``time_left``, which is 0 once the term is lost: read the deadline itself.
        while not done.done() and (left := leadership.deadline - clock()) > 0:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({done}, timeout=left)
        raise


def ended_by_loss(exc: BaseException, leadership: Leadership) -> bool:
    """True if *exc* is the `LeadershipLost` that ``leadership.check()`` raises at loss."""
    return isinstance(exc, LeadershipLost) and not leadership.is_valid


async def in_worker_thread(leadership: Leadership, fn: Callable[..., object], *args: Any) -> None:
    """Run ``fn(leadership, *args)`` in a new daemon thread and wait for it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[BaseException | None] = loop.create_future()

    def target() -> None:
        outcome: BaseException | None = None
        try:
            fn(leadership, *args)
        except BaseException as exc:
            if not ended_by_loss(exc, leadership):
                outcome = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            loop.call_soon_threadsafe(settle, done, outcome)

    name = f"multilock-leader-{leadership.group}-{leadership.token}"
    threading.Thread(target=target, name=name, daemon=True).start()
    error = await until_settled(done, leadership)
    if error is not None:
        raise error if isinstance(error, Exception) else Escaped(error)


def require_plain(fn: object, what: str, *, where: str, calls: str, instead: str) -> None:
    """Refuse an async function: called in a thread, it would only make a coroutine.

    The message says that *what* of *where* calls *calls* in a thread, and to await
    ``instead(...).what(fn)`` through the async API.
    """
    if not callable(fn):
        raise TypeError(f"{what}() needs a function; {describe_callable(fn)} is not callable")
    if is_async_callable(fn):
        raise TypeError(
            f"{what}() of {where} calls {calls} in a thread, and {describe_callable(fn)} is an "
            "async function: calling it would only create a coroutine that never runs. Await "
            f"it through the async API instead: await {instead}(...).{what}(fn)"
        )


async def on_loop(fn: Callable[..., T], *args: Any) -> T:
    """Call *fn* on the loop thread (where the state it reads lives)."""
    return fn(*args)


async def build(make: Callable[[Provider], T], provider: Provider | str) -> tuple[T, Provider]:
    """Make the async object on the loop thread, building the provider first from a URL."""
    if not isinstance(provider, str):
        return make(provider), provider
    built = from_url(provider)
    try:
        return make(built), built
    except BaseException:
        await built.aclose()
        raise


# ---------------------------------------------------------------------- the facades
class Facade:
    """A portal, a provider given or built from a URL, one close."""

    _kind = "object"

    def __init__(self, provider: Provider | str, loop_factory: LoopFactory | None) -> None:
        self._portal = BlockingPortal(loop_factory)
        self._state = threading.Lock()  # never held across a call to the loop
        self._closed = False
        self._owns_provider = isinstance(provider, str)
        self._where = redact_url(provider) if isinstance(provider, str) else repr(provider)

    def _make(self, make: Callable[[Provider], T], provider: Provider | str) -> tuple[T, Provider]:
        """Make the async object on the loop thread (see `build`); if that fails, end the
        portal and raise."""
        try:
            self._portal.check_thread(f"{type(self).__name__}()")
            return self._portal.call(build, make, provider)
        except BaseException:
            self._portal.close()
            raise

    def _call(self, what: str, fn: AsyncCall[T], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop and wait; raise instead of blocking forever."""
        self._portal.check_thread(what)
        if self._closed:
            raise MultilockError(f"{what}: {self!r} is closed")
        return self._portal.call(fn, *args)

    def _local(self, fn: Callable[[], T]) -> T:
        """Read local state: on the loop thread while it runs, directly once it cannot
        (closed, or called from the loop thread itself)."""
        portal = self._portal
        if self._closed or portal.in_loop_thread or not portal.running:
            return fn()
        return portal.call(on_loop(fn))

    @property
    def closed(self) -> bool:
        return self._closed

    def _repr(self, name: str, fields: str, provider: str) -> str:
        """``<multilock.core.sync.name fields [closed] provider=...>``."""
        closed = " closed" if self._closed else ""
        return f"<multilock.core.sync.{name} {fields}{closed} provider={provider}>"

    def close(self) -> None:
        """Release what is held, close a provider built from a URL, and end a private
        loop thread. Idempotent; the object cannot be used again."""
        self._portal.check_thread("close()")
        with self._state:
            if self._closed:
                return
            self._closed = True
        try:
            if self._portal.running:  # not after a fork, where the loop thread is gone
                self._portal.call(self._aclose)
        finally:
            self._portal.close()

    async def _aclose(self) -> None:
        raise NotImplementedError


class Lifetime(Facade):
    """A facade whose ``with`` block is its life: entering begins it (`_begin`), leaving
    ends it (`_end`); one built from a URL is closed instead, since nobody else holds its
    provider."""

    _provider: Provider

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        """What closing ends on the loop, before a provider built from a URL is closed."""
        raise NotImplementedError

    async def _aclose(self) -> None:
        try:
            await self._stop()
        finally:
            if self._owns_provider:
                await self._provider.aclose()

    def __enter__(self) -> Self:
        try:
            self._begin()
        except BaseException:
            if self._owns_provider:  # built from a URL: __exit__ will not run to close it
                self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._owns_provider:
            self.close()  # built from a URL: nobody else can close it
        else:
            self._end()
