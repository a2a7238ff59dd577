"""`DriverCalls`: how a provider calls its driver, bounded, with one kind of error.

Every provider needs the same four things around each driver call: refuse calls once
closed, bound the call in time, run a blocking driver in a worker thread without letting
a cancellation leave the store half-written, and turn the driver's failures into
`ProviderError` messages that name the store and the operation and never hold a secret.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, NoReturn, TypeVar

from ._errors import ProviderError
from ._failures import classify
from ._url import secrets_of

__all__ = ["DriverCalls"]

T = TypeVar("T")

_REDACTED = "***"


class DriverCalls:
    """Call one store's driver: ``await calls.call("renew", client.eval(...))``.

    *store* names the backend and *where* the server (a redacted URL or ``host:port``) in
    every message. *timeout* bounds each call. *failures* are the driver's exception types
    that mean "this call failed" (anything else is a bug and propagates as is). *secrets*
    (passwords, keys), and those of *url* (its password and secret query values), are cut
    from every message; a driver error whose text or chain holds one is not chained
    either, so no secret travels in ``__cause__``. *executor* runs the blocking calls
    (default: the loop's, which has few threads: a provider whose calls block for long,
    or that serves many elections, passes a pool of its own).
    """

    def __init__(
        self,
        store: str,
        where: str,
        *,
        timeout: float,
        failures: tuple[type[BaseException], ...] = (OSError,),
        secrets: Iterable[str] = (),
        url: str | None = None,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        self.store = store
        self.where = where
        self.timeout = timeout
        self.failures: tuple[type[BaseException], ...] = (*failures, TimeoutError)
        found = [*secrets, *(secrets_of(url) if url is not None else ())]
        self._secrets = sorted({s for s in found if s}, key=len, reverse=True)
        self.executor = executor
        self.closed = False

    def __repr__(self) -> str:
        return f"<DriverCalls {self.store} {self.where}{' closed' if self.closed else ''}>"

    def scrub(self, text: str) -> str:
        """*text* with every secret replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, _REDACTED)
        return text

    def error(self, op: str, exc: BaseException) -> ProviderError:
        """The `ProviderError` for *exc* raised by the driver during *op*."""
        if isinstance(exc, TimeoutError) and not str(exc):
            detail = f"no answer within {self.timeout:g} s"
        else:
            detail = self.scrub(str(exc).strip()) or type(exc).__name__
        message = f"{self.store} {op} failed on {self.where}: {detail}"
        if self._holds_secret(exc):  # not chained: classify it now, while it is at hand
            error = ProviderError(message, reason=classify(exc))
        else:
            error = ProviderError(message)
            error.__cause__ = exc
        error.__suppress_context__ = True
        return error

    def fail(self, op: str, exc: BaseException) -> NoReturn:
        """Raise `error` for *exc*.

        Call it after the ``except`` block, not inside it: an exception raised while
        another is handled keeps that one as its ``__context__``, so a driver error that
        holds a secret would travel on (suppressed, but reachable)::

            try:
                ...
            except DriverError as exc:
                failure = exc
            calls.fail("renew", failure)
        """
        raise self.error(op, exc)

    def _holds_secret(self, exc: BaseException | None) -> bool:
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            if self.scrub(f"{exc} {exc!r}") != f"{exc} {exc!r}":
                return True
            exc = exc.__cause__ or exc.__context__
        return False

    def _check_open(self, call: object = None) -> None:
        if self.closed:
            if isinstance(call, Coroutine):
                call.close()
            raise ProviderError(f"the {self.store} provider for {self.where} is closed")

    async def call(self, op: str, call: Awaitable[T], *, limit: float | None = None) -> T:
        """Await one driver call within *limit* seconds (default: the timeout)."""
        return await self._await(op, call, self.timeout if limit is None else limit)

    async def batched(self, op: str, call: Awaitable[T]) -> T:
        """Await a call sent through `Batches` (``batches(item)``), which bounds itself:
        the batch on its way when it was asked for, then its own, each within the batches'
        timeout. Failures become `ProviderError` as `call`'s do; no deadline is added, so
        a herd's callers wait for the batch that answers them."""
        return await self._await(op, call, None)

    async def _await(self, op: str, call: Awaitable[T], limit: float | None) -> T:
        self._check_open(call)
        try:
            async with asyncio.timeout(limit):  # None: no timer at all
                return await call
        except ProviderError:
            raise
        except self.failures as exc:
            error = self.error(op, exc)
        raise error  # outside the handler: see `fail`

    async def blocking(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking *fn* in a worker thread, bounded by the timeout.

        A thread cannot be stopped: when the caller is cancelled, this waits (up to the
        timeout, which the driver's own socket timeouts should also respect) for *fn* to
        finish, so that the store is in its final state when the cancellation returns.
        """
        self._check_open()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, functools.partial(fn, *args))
        # Whatever the thread ends with is retrieved, so nobody is told "never retrieved".
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            async with asyncio.timeout(self.timeout):
                return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait([future], timeout=self.timeout)
            raise
        except ProviderError:
            raise
        except self.failures as exc:
            error = self.error(op, exc)
        raise error  # outside the handler: see `fail`
