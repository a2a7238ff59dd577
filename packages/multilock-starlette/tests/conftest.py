"""Serve an app as uvicorn does, in-process: the ASGI lifespan protocol, then requests.

Starlette's TestClient runs on its own thread in real time (and warns about its httpx);
this runs on the test's event loop, so a `FakeClock` drives everything.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

Serve = Callable[[Any], contextlib.AbstractAsyncContextManager[httpx.AsyncClient]]


@contextlib.asynccontextmanager
async def _serve(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """Run *app*'s lifespan startup, yield a client, run its shutdown on exit.

    Like a server, the lifespan state is copied into each request's scope. A failed
    startup or shutdown raises the app's exception.
    """
    state: dict[str, Any] = {}
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}
    lifespan = asyncio.ensure_future(app({**scope, "state": state}, inbox.get, outbox.put))

    async def step(message: str) -> None:
        await inbox.put({"type": f"lifespan.{message}"})
        getter = asyncio.ensure_future(outbox.get())
        await asyncio.wait({getter, lifespan}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            lifespan.result()  # raises what the app raised
            raise AssertionError(f"the app ended its lifespan without answering {message}")
        answer = getter.result()
        if answer["type"] != f"lifespan.{message}.complete":
            if lifespan.done() or answer["type"].endswith(".failed"):
                with contextlib.suppress(asyncio.CancelledError):
                    await lifespan  # raises the app's exception, if it has one
            raise AssertionError(f"lifespan {message} failed: {answer}")

    async def with_state(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await app({**scope, "state": dict(state)}, receive, send)

    await step("startup")
    try:
        transport = httpx.ASGITransport(app=with_state)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client
    finally:
        await step("shutdown")
        await lifespan


@pytest.fixture
def serve() -> Serve:
    return _serve
