"""`leader_lifespan`: one leader election for the lifetime of a FastAPI or Starlette app.

What it guarantees: the election starts when the app starts (the ASGI lifespan
``startup``) and stops when it stops (``shutdown``, which uvicorn runs on SIGTERM and
Ctrl-C); stopping cancels the leader work and then releases the lease, so another replica
takes over at once instead of after the lease. ``run`` runs only while this replica
leads, in the term's own task, cancelled the moment the term ends.

What it does not: a replica that is killed (SIGKILL, OOM, power loss) runs no shutdown,
so the others take over only once its lease expires. The lifespan is per process: with
``uvicorn --workers N`` each worker is a replica of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from starlette.applications import Starlette

from multilock.core import (
    ConfigurationError,
    ElectionOptions,
    ElectionState,
    EventKind,
    LeaderElection,
    Leadership,
    LeadershipEvent,
    Provider,
    from_url,
    on_transition,
)

__all__ = ["leader_lifespan"]

log = logging.getLogger(__name__)

AppT = TypeVar("AppT", bound=Starlette)

#: The lifespan state key: ``request.state.election`` in every request handler.
STATE_KEY = "election"
#: The attribute of ``app.state`` that holds the election too, for code without a request.
APP_STATE_ATTRIBUTE = "multilock_election"

LeaderWork = Callable[[Leadership], Coroutine[Any, Any, Any]]
EventCallback = Callable[[LeadershipEvent], Awaitable[None] | None]
#: A user's own lifespan: stateless (yields nothing) or stateful (yields a mapping).
UserLifespan = Callable[[AppT], AbstractAsyncContextManager[Mapping[str, Any] | None]]


def leader_lifespan(
    provider_or_url: Provider | str,
    *,
    group: str,
    run: LeaderWork | None = None,
    on_acquired: EventCallback | None = None,
    on_lost: EventCallback | None = None,
    close_provider: bool | None = None,
    lifespan: UserLifespan[AppT] | None = None,
    **election_options: Any,
) -> Callable[[AppT], AbstractAsyncContextManager[dict[str, Any]]]:
    """Return a lifespan (``FastAPI(lifespan=...)``) that campaigns for *group* while the app runs.

    On startup: enter *lifespan* (the app's own, if given), build the provider
    (``from_url`` when given a URL), start a `LeaderElection` with *election_options*
    (``lease_duration=...``, ``participant_id=...``, any `ElectionOptions` field), and
    when *run* is given, ``election.run_while_leader(run)`` in a background task:
    ``await run(leadership)`` runs only on the leader, is cancelled when the term ends
    and starts again in the next term. If *run* raises, the core resigns the term (the
    error is logged) and the work starts again in a later term. *on_acquired* and
    *on_lost* (sync or async, given the `LeadershipEvent`) are called on each transition.

    The election is yielded as the lifespan state ``{"election": election}`` (merged over
    the app's own lifespan state), so handlers read ``request.state.election``; it is also
    set as ``app.state.multilock_election``.

    On shutdown, in reverse: stop the election (leader work cancelled, lease released),
    wait for the background tasks, close the provider (by default only one built here
    from a URL; ``close_provider=True`` closes a given one too, ``False`` never), then
    exit the app's own lifespan. A shutdown that is cancelled (a server's or a test
    harness's timeout) ends at once, as `LeaderElection.stop` does: the stop and the
    provider's close go on in the background, in that order, so the lease is still
    released; the app's own lifespan is exited at once.

    Everything is checked here, when the app is built, so a mistake fails at import
    rather than at the first deploy: `ConfigurationError` names the bad argument.
    """
    if not isinstance(provider_or_url, Provider | str):
        raise ConfigurationError(
            "provider_or_url must be a multilock Provider or a URL string, not "
            f"{type(provider_or_url).__name__}"
        )
    if run is not None and not _is_async_function(run):
        raise ConfigurationError(
            f"run must be an async def function taking the Leadership; {_describe(run)} is "
            "not (define it with async def; bind extra arguments with functools.partial)"
        )
    for name, callback in (("on_acquired", on_acquired), ("on_lost", on_lost)):
        if callback is not None and not callable(callback):
            raise ConfigurationError(f"{name} must be callable, not {type(callback).__name__}")
    if close_provider is not None and not isinstance(close_provider, bool):
        raise ConfigurationError(
            f"close_provider must be None, True or False, not {close_provider!r}"
        )
    if lifespan is not None and not callable(lifespan):
        raise ConfigurationError(
            f"lifespan must be the app's lifespan function, not {type(lifespan).__name__}"
        )
    fields = {"group": group, **election_options}
    # Validate now; the election itself is built per startup, so every process (and every
    # restart of the app) gets a participant id of its own.
    ElectionOptions.from_fields(fields)
    owns_provider = isinstance(provider_or_url, str) if close_provider is None else close_provider

    @contextlib.asynccontextmanager
    async def leader_lifespan_context(app: AppT) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.AsyncExitStack() as stack:
            state: dict[str, Any] = {}
            if lifespan is not None:
                own_state = await stack.enter_async_context(lifespan(app))
                state.update(own_state or {})
            provider = (
                from_url(provider_or_url) if isinstance(provider_or_url, str) else provider_or_url
            )
            closing = provider if owns_provider else None
            try:
                election = LeaderElection(provider, **fields)
            except BaseException:
                if closing is not None:
                    await closing.aclose()
                raise
            tasks: list[asyncio.Task[None]] = []
            stack.push_async_callback(_shutdown, election, tasks, closing)
            if on_acquired is not None or on_lost is not None:
                # Subscribed before start(), so the first ACQUIRED cannot be missed.
                stream = election.events(EventKind.ACQUIRED | EventKind.LOST)
                callbacks = on_transition(
                    stream,
                    on_acquired=_logged(on_acquired, "on_acquired"),
                    on_lost=_logged(on_lost, "on_lost"),
                )
                tasks.append(asyncio.create_task(callbacks, name=f"multilock-events-{group}"))
            await election.start()
            if run is not None:
                work = _run_while_leader(election, run)
                tasks.append(asyncio.create_task(work, name=f"multilock-run-{group}"))
            setattr(app.state, APP_STATE_ATTRIBUTE, election)
            yield {**state, STATE_KEY: election}

    return leader_lifespan_context


async def _run_while_leader(election: LeaderElection, run: LeaderWork) -> None:
    """Run *run* in every term until the election stops, surviving its exceptions.

    The core resigns the term and logs the error when *run* raises; starting again keeps
    this replica a useful candidate (a transient error must not leave it leading nothing).
    """
    while True:
        try:
            await election.run_while_leader(run)
            return  # the election stopped
        except Exception:
            if election.state not in (ElectionState.CAMPAIGNING, ElectionState.LEADING):
                return
            log.info("leader work of %s will start again in the next term", election.group)


#: Shutdowns whose caller was cancelled, finishing in the background (held until done).
_FINISHING: set[asyncio.Task[None]] = set()


async def _shutdown(
    election: LeaderElection, tasks: list[asyncio.Task[None]], provider: Provider | None
) -> None:
    """Stop the election, wait for the tasks that end with it, then close *provider*.

    In a task of its own, shielded: a cancelled shutdown (a server's or a test harness's
    timeout) returns at once, as `LeaderElection.stop` does, while the stop goes on in the
    background and closes the provider only once it is over. Closing the provider as the
    exit stack unwinds would close it under the release, and leave the lease to expire.
    """
    finishing = asyncio.get_running_loop().create_task(
        _stop_then_close(election, tasks, provider), name=f"multilock-shutdown-{election.group}"
    )
    try:
        await asyncio.shield(finishing)
    except asyncio.CancelledError:
        if not finishing.done():
            log.warning(
                "the shutdown of %s was cancelled: the election stops in the background",
                election.group,
            )
            _FINISHING.add(finishing)
            finishing.add_done_callback(_finished)
        raise


async def _stop_then_close(
    election: LeaderElection, tasks: list[asyncio.Task[None]], provider: Provider | None
) -> None:
    try:
        try:
            await election.stop()
        finally:
            for task in tasks:
                if not task.done() and election.state is not ElectionState.STOPPED:
                    task.cancel()  # stop() failed: the tasks would not end by themselves
            if tasks:
                await asyncio.wait(tasks)
    finally:
        if provider is not None:
            await provider.aclose()


def _finished(task: asyncio.Task[None]) -> None:
    """A shutdown that finished in the background: nobody awaits it, so log its error."""
    _FINISHING.discard(task)
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("the shutdown of the election failed", exc_info=error)


def _logged(callback: EventCallback | None, name: str) -> EventCallback | None:
    """Wrap *callback* so one that raises is logged and the next transition still calls it."""
    if callback is None:
        return None

    async def call(event: LeadershipEvent) -> None:
        try:
            result = callback(event)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("%s raised on %s of %s", name, event.kind.name, event.group)

    return call


def _is_async_function(fn: object) -> bool:
    """True for an ``async def`` function, a partial of one, or an object whose
    ``__call__`` is one: what ``run_while_leader`` can start as a task."""
    if inspect.iscoroutinefunction(fn):
        return True
    # Looked up on the type: a class whose instances are async callables is not one itself.
    return callable(fn) and inspect.iscoroutinefunction(type(fn).__call__)


def _describe(fn: object) -> str:
    name = getattr(fn, "__qualname__", None)
    if inspect.isfunction(fn):
        return f"the plain function {name!r}"
    return f"{name!r}" if name else f"a {type(fn).__name__} object"
