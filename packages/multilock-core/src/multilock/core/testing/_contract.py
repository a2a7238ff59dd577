"""`check_provider`: the contract every provider passes, written once, run for every backend.

Each check uses its own freshly made group name, so the checks can run against a shared,
long-lived server. Time is the running event loop's clock: real time against real stores,
virtual time when run under `FakeClock` with an `InMemoryProvider` on the same clock.
Checks that need a lease to expire use ``lease_duration`` seconds and wait on conditions
with deadlines, never on a sleep that merely hopes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs

from .._errors import ConfigurationError, UnsupportedOperation
from .._provider import Provider
from .._types import LeaderInfo

__all__ = ["PROVIDER_CHECKS", "ProviderFactory", "check_provider"]

ProviderFactory = Callable[[], Provider | Awaitable[Provider]]


@attrs.define
class _Ctx:
    factory: ProviderFactory
    lease: float
    providers: list[Provider] = attrs.field(factory=list)

    async def provider(self) -> Provider:
        made = self.factory()
        provider = await made if inspect.isawaitable(made) else made
        self.providers.append(provider)
        return provider

    def group(self) -> str:
        return f"contract-{uuid.uuid4().hex[:12]}"

    async def close(self) -> None:
        for provider in self.providers:
            await provider.aclose()


def _now() -> float:
    """The running loop's clock: real time normally, virtual time under `FakeClock`."""
    return asyncio.get_running_loop().time()


async def _wait_for(
    what: str, predicate: Callable[[], Awaitable[bool]], within: float, step: float = 0.05
) -> float:
    """Poll *predicate* until true; return seconds waited; fail after *within* seconds."""
    start = _now()
    while True:
        if await predicate():
            return _now() - start
        if _now() - start > within:
            raise AssertionError(f"timed out after {within:.1f} s waiting for {what}")
        await asyncio.sleep(step)


async def _acquire_once_free(
    p: Provider, group: str, participant_id: str, lease: float, what: str
) -> LeaderInfo:
    """``try_acquire`` on a group ``get_leader`` just reported free, retried for a moment.

    A quorum store (Redlock) reports nobody as soon as fewer than a majority of its
    servers hold the lease, while the rest expire it a few milliseconds later: the group
    must become free within ``_FREE_SKEW`` seconds, not necessarily at the same instant.
    """
    taken: LeaderInfo | None = None

    async def acquired() -> bool:
        nonlocal taken
        taken = await p.try_acquire(group, participant_id, lease, {})
        return taken is not None

    await _wait_for(what, acquired, _FREE_SKEW, step=0.01)
    assert taken is not None
    return taken


#: How long a store may take to free a group after `get_leader` first reports nobody.
_FREE_SKEW = 0.5


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


async def check_invalid_names_rejected(ctx: _Ctx) -> None:
    p = await ctx.provider()
    good = ctx.group()
    for bad in ["", "has space", "slash/name", "x" * 256, "quote'", "semi;colon", "ünï"]:
        calls: list[tuple[str, Awaitable[Any]]] = [
            ("try_acquire(group)", p.try_acquire(bad, "p1", ctx.lease, {})),
            ("try_acquire(participant_id)", p.try_acquire(good, bad, ctx.lease, {})),
            ("renew(group)", p.renew(bad, "p1", 1, ctx.lease, {})),
            ("renew(participant_id)", p.renew(good, bad, 1, ctx.lease, {})),
            ("release(group)", p.release(bad, "p1", 1)),
            ("release(participant_id)", p.release(good, bad, 1)),
            ("get_leader(group)", p.get_leader(bad)),
            ("contenders(group)", p.contenders(bad)),
        ]
        for name, call in calls:
            try:
                await call
            except ConfigurationError:
                continue
            raise AssertionError(f"{name} accepted the invalid name {bad!r}")
    _expect(await p.get_leader(good) is None, "a rejected call left a leader behind")


async def check_one_winner_among_concurrent(ctx: _Ctx) -> None:
    providers = [await ctx.provider() for _ in range(4)]
    for _round in range(3):
        group = ctx.group()
        results = await asyncio.gather(
            *(
                providers[i % len(providers)].try_acquire(group, f"p{i}", ctx.lease * 4, {})
                for i in range(20)
            )
        )
        winners = [r for r in results if r is not None]
        _expect(len(winners) == 1, f"{len(winners)} of 20 concurrent try_acquire calls won")
        leader = await providers[0].get_leader(group)
        _expect(
            leader is not None and leader.participant_id == winners[0].participant_id,
            f"get_leader reports {leader!r}, but {winners[0].participant_id} won",
        )
        await providers[0].release(group, winners[0].participant_id, winners[0].token)


async def check_live_term_is_never_shared(ctx: _Ctx) -> None:
    """A live term belongs to whoever created it, even against the same participant id.

    Two processes configured with the same participant id (a pod name, a fixed config
    value) each have their own provider: the second one's ``try_acquire`` must not join the
    first one's live term. The provider that created the term may answer a repeated
    ``try_acquire`` with that same term (a store that queues candidates does), but never
    with its metadata rewritten: the election recognises its own terms by their metadata.
    """
    p, q = await ctx.provider(), await ctx.provider()
    group = ctx.group()
    first = await p.try_acquire(group, "p1", ctx.lease * 4, {"instance": "a"})
    _expect(first is not None, "try_acquire on a free group failed")
    assert first is not None
    other = await q.try_acquire(group, "p1", ctx.lease * 4, {"instance": "b"})
    _expect(
        other is None,
        f"a second provider with the same participant id joined the live term: {other!r}",
    )
    again = await p.try_acquire(group, "p1", ctx.lease * 4, {"instance": "c"})
    _expect(
        again is None or (again.token == first.token and dict(again.metadata) == {"instance": "a"}),
        f"a repeated try_acquire by the holder gave {again!r}, not None or the same term "
        f"{first.token} with its metadata unchanged",
    )
    _expect(await p.try_acquire(group, "p2", ctx.lease * 4, {}) is None, "p2 stole the lease")
    leader = await q.get_leader(group)
    _expect(
        leader is not None
        and leader.token == first.token
        and dict(leader.metadata) == {"instance": "a"},
        f"after the refused attempts get_leader reports {leader!r}, not the first term as made",
    )
    _expect(
        await p.renew(group, "p1", first.token, ctx.lease * 4, {"instance": "a"}),
        "the holder could not renew its term after the refused attempts",
    )
    await p.release(group, "p1", first.token)


async def check_contenders_start_with_the_leader(ctx: _Ctx) -> None:
    """``contenders`` raises `UnsupportedOperation`, or lists the leader first."""
    p, q = await ctx.provider(), await ctx.provider()
    group = ctx.group()
    try:
        empty = await q.contenders(group)
    except UnsupportedOperation:
        return  # the store records only the leader: nothing more to check
    _expect(_is_names(empty) and len(empty) == 0, f"a fresh group has contenders {empty!r}")
    info = await p.try_acquire(group, "p1", ctx.lease * 4, {})
    assert info is not None, "try_acquire on a free group failed"
    _expect(await q.try_acquire(group, "p2", ctx.lease * 4, {}) is None, "p2 stole the lease")
    names = await q.contenders(group)
    _expect(
        _is_names(names) and list(names[:1]) == ["p1"],
        f"contenders gave {names!r}: not a sequence of participant ids led by the leader p1",
    )
    await p.release(group, "p1", info.token)


def _is_names(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(name, str) for name in value)
    )


async def check_renew_extends(ctx: _Ctx) -> None:
    p = await ctx.provider()
    group = ctx.group()
    info = await p.try_acquire(group, "p1", ctx.lease, {})
    assert info is not None, "try_acquire on a free group failed"
    started = _now()
    for _ in range(3):
        await asyncio.sleep(ctx.lease * 0.5)
        _expect(
            await p.renew(group, "p1", info.token, ctx.lease, {}),
            "renew by the holder failed",
        )
    # 1.5 leases have passed: without the renewals the lease would be gone.
    _expect(_now() - started >= ctx.lease * 1.5, "the clock did not move")
    leader = await p.get_leader(group)
    _expect(
        leader is not None and leader.token == info.token,
        f"after renewals get_leader reports {leader!r}, not token {info.token}",
    )
    _expect(await p.try_acquire(group, "p2", ctx.lease, {}) is None, "renewed lease was taken")
    await p.release(group, "p1", info.token)


async def check_renew_requires_owner_and_token(ctx: _Ctx) -> None:
    p = await ctx.provider()
    group = ctx.group()
    info = await p.try_acquire(group, "p1", ctx.lease * 4, {"k": "v"})
    assert info is not None, "try_acquire on a free group failed"
    _expect(not await p.renew(group, "p2", info.token, ctx.lease, {}), "renew by a non-owner")
    _expect(not await p.renew(group, "p1", info.token - 1, ctx.lease, {}), "stale token renewed")
    _expect(not await p.renew(group, "p1", info.token + 1, ctx.lease, {}), "future token renewed")
    _expect(not await p.renew(ctx.group(), "p1", info.token, ctx.lease, {}), "renew of free group")
    leader = await p.get_leader(group)
    _expect(
        leader is not None and leader.participant_id == "p1" and leader.token == info.token,
        f"a failed renew changed the record: {leader!r}",
    )
    await p.release(group, "p1", info.token)


async def check_release_frees_at_once(ctx: _Ctx) -> None:
    p, q = await ctx.provider(), await ctx.provider()
    group = ctx.group()
    info = await p.try_acquire(group, "p1", ctx.lease * 20, {})
    assert info is not None, "try_acquire on a free group failed"
    await p.release(group, "p1", info.token)
    _expect(await q.get_leader(group) is None, "get_leader reports a leader after release")
    taken = await q.try_acquire(group, "p2", ctx.lease * 4, {})
    _expect(taken is not None, "another participant could not acquire right after release")
    assert taken is not None
    _expect(taken.token > info.token, f"token went from {info.token} to {taken.token}")
    _expect(not await p.renew(group, "p1", info.token, ctx.lease, {}), "renew after release")
    await q.release(group, "p2", taken.token)


async def check_release_by_non_owner_is_noop(ctx: _Ctx) -> None:
    p = await ctx.provider()
    group = ctx.group()
    info = await p.try_acquire(group, "p1", ctx.lease * 4, {})
    assert info is not None, "try_acquire on a free group failed"
    await p.release(group, "p2", info.token)
    await p.release(group, "p1", info.token - 1)
    await p.release(group, "p1", info.token + 1)
    await p.release(ctx.group(), "p1", info.token)
    leader = await p.get_leader(group)
    _expect(
        leader is not None and leader.participant_id == "p1" and leader.token == info.token,
        f"a release by a non-owner changed the leader to {leader!r}",
    )
    _expect(await p.renew(group, "p1", info.token, ctx.lease, {}), "holder lost its lease")
    await p.release(group, "p1", info.token)


async def check_expiry_frees_the_group(ctx: _Ctx) -> None:
    p, q = await ctx.provider(), await ctx.provider()
    group = ctx.group()
    started = _now()
    info = await p.try_acquire(group, "p1", ctx.lease, {})
    assert info is not None, "try_acquire on a free group failed"
    _expect(await q.try_acquire(group, "p2", ctx.lease, {}) is None, "a live lease was taken")

    async def nobody() -> bool:
        return await q.get_leader(group) is None

    await _wait_for("get_leader to report nobody after expiry", nobody, ctx.lease * 3 + 5)
    elapsed = _now() - started
    _expect(
        elapsed >= ctx.lease * 0.9,
        f"the lease vanished after {elapsed:.3f} s, before lease_duration={ctx.lease}",
    )
    taken = await _acquire_once_free(
        q, group, "p2", ctx.lease, "the group to be free after the lease expired"
    )
    _expect(taken.token > info.token, f"token went from {info.token} to {taken.token}")
    _expect(not await p.renew(group, "p1", info.token, ctx.lease, {}), "expired holder renewed")
    await p.release(group, "p1", info.token)
    leader = await q.get_leader(group)
    _expect(
        leader is not None and leader.participant_id == "p2",
        f"the expired holder's release removed the new leader: {leader!r}",
    )
    await q.release(group, "p2", taken.token)


async def check_tokens_strictly_increase(ctx: _Ctx) -> None:
    p = await ctx.provider()
    group = ctx.group()
    tokens: list[int] = []
    for participant in ["p1", "p1", "p2", "p1"]:  # re-acquire by the same participant too
        info = await p.try_acquire(group, participant, ctx.lease * 4, {})
        assert info is not None, f"try_acquire by {participant} failed on a released group"
        tokens.append(info.token)
        await p.release(group, participant, info.token)
    info = await p.try_acquire(group, "p3", ctx.lease, {})
    assert info is not None
    tokens.append(info.token)

    async def free() -> bool:
        return await p.get_leader(group) is None

    await _wait_for("the lease to expire", free, ctx.lease * 3 + 5)
    info = await _acquire_once_free(p, group, "p3", ctx.lease * 4, "a re-acquire after expiry")
    tokens.append(info.token)
    await p.release(group, "p3", info.token)
    _expect(
        all(a < b for a, b in itertools.pairwise(tokens)),
        f"tokens did not strictly increase: {tokens}",
    )


async def check_metadata_round_trip_and_limits(ctx: _Ctx) -> None:
    p = await ctx.provider()
    group = ctx.group()
    meta = {"host": "web-1", "unicode": "ünïcødé ✓", "empty": "", "long": "x" * 4000}
    info = await p.try_acquire(group, "p1", ctx.lease * 4, meta)
    assert info is not None, "try_acquire on a free group failed"
    _expect(dict(info.metadata) == meta, f"try_acquire returned metadata {info.metadata!r}")
    leader = await p.get_leader(group)
    _expect(leader is not None and dict(leader.metadata) == meta, "metadata did not round trip")
    _expect(await p.renew(group, "p1", info.token, ctx.lease * 4, {"v": "2"}), "renew failed")
    leader = await p.get_leader(group)
    _expect(
        leader is not None and dict(leader.metadata) == {"v": "2"},
        f"renew did not update metadata: {leader!r}",
    )
    await p.release(group, "p1", info.token)
    fresh = ctx.group()
    too_many = {f"k{i}": "v" for i in range(101)}
    bad: list[Mapping[str, str]] = [too_many, {"k": "x" * 4001}, {"": "v"}, {"k" * 256: "v"}]
    for metadata in bad:
        try:
            await p.try_acquire(fresh, "p1", ctx.lease, metadata)
        except ConfigurationError:
            continue
        raise AssertionError(f"metadata over the limits was accepted: {len(metadata)} entries")
    _expect(await p.get_leader(fresh) is None, "rejected metadata left a record behind")


async def check_cancelled_acquire_leaves_store_consistent(ctx: _Ctx) -> None:
    p, q = await ctx.provider(), await ctx.provider()
    for delay in [0.0, 0.001, 0.005, 0.02]:
        group = ctx.group()
        task = asyncio.ensure_future(p.try_acquire(group, "p1", ctx.lease * 4, {}))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        leader = await q.get_leader(group)
        _expect(
            leader is None or leader.participant_id == "p1",
            f"a cancelled acquire left a foreign record: {leader!r}",
        )
        if leader is not None:
            # It went through before the cancel: the holder finds it with get_leader (as
            # the election does, by its metadata) and ends it with the token it reads.
            await p.release(group, "p1", leader.token)
            _expect(await q.get_leader(group) is None, "the found term could not be released")
        taken = await q.try_acquire(group, "p2", ctx.lease * 4, {})
        _expect(taken is not None, "after a cancelled acquire the group could not be taken")
        assert taken is not None
        await q.release(group, "p2", taken.token)


async def check_watch_wakes_on_release(ctx: _Ctx) -> None:
    p, q = await ctx.provider(), await ctx.provider()
    group = ctx.group()
    watch = q.watch(group)
    if watch is None:
        return  # a polling backend: nothing to check
    info = await p.try_acquire(group, "p1", ctx.lease * 20, {})
    assert info is not None, "try_acquire on a free group failed"
    woke = asyncio.Event()
    watching = asyncio.Event()

    async def follow() -> None:
        async for _ in watch:
            if not watching.is_set():
                watching.set()  # the first yield: subscribed, no later change is missed
            elif await q.get_leader(group) is None:
                woke.set()
                return

    follower = asyncio.ensure_future(follow())
    try:
        await _within(watching, max(2.0, ctx.lease), "the watch never yielded its first time")
        await p.release(group, "p1", info.token)
        try:
            async with asyncio.timeout(max(2.0, ctx.lease)):
                await woke.wait()
        except TimeoutError:
            raise AssertionError("watch did not wake the follower after a release") from None
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        aclose = getattr(watch, "aclose", None)
        if aclose is not None:
            await aclose()


async def _within(event: asyncio.Event, seconds: float, failure: str) -> None:
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        raise AssertionError(failure) from None


async def check_one_provider_watches_many_groups(ctx: _Ctx) -> None:
    """Watches of many groups (two per group) on one provider each see their own group."""
    p, q = await ctx.provider(), await ctx.provider()
    groups = [ctx.group() for _ in range(10)]
    if q.watch(groups[0]) is None:
        return  # a polling backend with no watch
    terms = {}
    for group in groups:
        info = await p.try_acquire(group, "p1", ctx.lease * 20, {})
        assert info is not None, "try_acquire on a free group failed"
        terms[group] = info
    released = {groups[2], groups[7]}
    streams = [(group, q.watch(group)) for group in groups for _ in range(2)]
    ready = [asyncio.Event() for _ in streams]
    woke = [asyncio.Event() for _ in streams]

    async def follow(i: int) -> None:
        group, stream = streams[i]
        assert stream is not None
        async for _ in stream:
            if not ready[i].is_set():
                ready[i].set()
            elif await q.get_leader(group) is None:
                woke[i].set()
                return

    followers = [asyncio.ensure_future(follow(i)) for i in range(len(streams))]
    try:
        limit = max(2.0, ctx.lease)
        for event in ready:
            await _within(event, limit, "a watch never yielded its first time")
        for group in released:
            await p.release(group, "p1", terms[group].token)
        for i, (group, _) in enumerate(streams):
            if group in released:
                await _within(woke[i], limit, f"a watch of {group} missed its release")
        _expect(
            not any(woke[i].is_set() for i, (g, _) in enumerate(streams) if g not in released),
            "a watch reported a group free while it was held",
        )
    finally:
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        for _, stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        for group in set(groups) - released:
            await p.release(group, "p1", terms[group].token)


async def check_aclose_is_idempotent(ctx: _Ctx) -> None:
    made = ctx.factory()
    p = await made if inspect.isawaitable(made) else made
    await p.aclose()
    await p.aclose()


PROVIDER_CHECKS: dict[str, Callable[[_Ctx], Awaitable[None]]] = {
    fn.__name__.removeprefix("check_"): fn
    for fn in [
        check_invalid_names_rejected,
        check_one_winner_among_concurrent,
        check_live_term_is_never_shared,
        check_contenders_start_with_the_leader,
        check_renew_extends,
        check_renew_requires_owner_and_token,
        check_release_frees_at_once,
        check_release_by_non_owner_is_noop,
        check_expiry_frees_the_group,
        check_tokens_strictly_increase,
        check_metadata_round_trip_and_limits,
        check_cancelled_acquire_leaves_store_consistent,
        check_watch_wakes_on_release,
        check_one_provider_watches_many_groups,
        check_aclose_is_idempotent,
    ]
}


async def check_provider(
    factory: ProviderFactory,
    *,
    lease_duration: float = 1.0,
    only: str | None = None,
) -> None:
    """Run the provider contract; raise `AssertionError` naming the first broken rule.

    *factory* makes a new provider connected to the store under test (sync or async); the
    checks close what they made. *lease_duration* is the short lease the expiry checks
    use, in seconds; use the backend's minimum if it has one. *only* runs one check by
    name (see `PROVIDER_CHECKS`), handy for ``pytest.mark.parametrize``.
    """
    names = [only] if only is not None else list(PROVIDER_CHECKS)
    for name in names:
        if name not in PROVIDER_CHECKS:
            raise ValueError(f"unknown check {name!r}; known: {', '.join(PROVIDER_CHECKS)}")
        ctx = _Ctx(factory=factory, lease=lease_duration)
        try:
            await PROVIDER_CHECKS[name](ctx)
        except AssertionError as exc:
            raise AssertionError(f"provider contract {name!r} failed: {exc}") from exc
        finally:
            await ctx.close()
