"""`PostgresProvider` against a real PostgreSQL server: what only a server can show.

The shared contract (`check_provider`) runs here on the default table and on a custom,
mixed-case schema and table; the rest covers the table layout, refused acquires writing
nothing, server restarts, LISTEN/NOTIFY wake-ups, races, timeouts and connections or
pools passed in by the caller.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.pq import TransactionStatus

from harness import BaseServer, require_control
from harness.leading import lead_through
from multilock.core import ConfigurationError, ProviderError, from_url
from multilock.core.testing import PROVIDER_CHECKS, check_provider
from multilock.postgres import PostgresProvider
from multilock.postgres._connections import MAX_CONNECTIONS
from multilock.postgres._sql import channel_name


def fresh(prefix: str = "pg") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def url(postgres_server: BaseServer) -> str:
    return postgres_server.url


async def query(
    url: str, statement: sql.SQL | sql.Composed, *params: object
) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(statement, list(params) or None)
        return await cur.fetchall() if cur.description is not None else []


async def next_within(watch: AsyncIterator[None], seconds: float) -> float:
    """Wait for the watch's next wake-up; return how long it took."""
    started = time.monotonic()
    async with asyncio.timeout(seconds):
        await anext(watch)
    return time.monotonic() - started


@pytest.mark.parametrize("layout", ["default", "custom"])
@pytest.mark.parametrize("check", list(PROVIDER_CHECKS))
async def test_provider_contract(url: str, check: str, layout: str) -> None:
    # "custom" names need quoting (mixed case) and live in a schema the provider creates.
    names: dict[str, Any] = {}
    if layout == "custom":
        names = {"schema": "MultiLock_Test", "table": "Leases"}
    await check_provider(lambda: PostgresProvider(url, **names), lease_duration=1.0, only=check)


async def test_custom_schema_and_table_are_quoted_and_separate(url: str) -> None:
    schema, table = f"Election_{uuid.uuid4().hex[:8]}", "LeaseTable"
    group = fresh()
    try:
        async with (
            PostgresProvider(url, schema=schema, table=table) as custom,
            PostgresProvider(url) as default,
        ):
            info = await custom.try_acquire(group, "p1", 30, {"k": "v"})
            assert info is not None
            assert await default.get_leader(group) is None, "the default table saw the lease"
            assert await default.try_acquire(group, "p2", 30, {}) is not None
            rows = await query(
                url, sql.SQL("SELECT tablename FROM pg_tables WHERE schemaname = %s"), schema
            )
            assert rows == [(table,)], "the table was not created with its name as written"
            row = await query(
                url,
                sql.SQL("SELECT participant_id, token FROM {} WHERE group_name = %s").format(
                    sql.Identifier(schema, table)
                ),
                group,
            )
            assert row == [("p1", info.token)]
    finally:
        await query(url, sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


async def test_bad_names_are_rejected_before_any_sql(url: str) -> None:
    count = sql.SQL("SELECT (SELECT count(*) FROM pg_class), (SELECT count(*) FROM pg_namespace)")
    before = await query(url, count)
    for bad in ['x"; DROP TABLE multilock_leases; --', "has space", "1st", "a" * 64, "dash-ed"]:
        with pytest.raises(ConfigurationError, match="schema"):
            PostgresProvider(url, schema=bad)
        with pytest.raises(ConfigurationError, match="table"):
            PostgresProvider(url, table=bad)
    with pytest.raises(ConfigurationError, match="table"):
        from_url(f"{url}?table=bad%22name")
    assert await query(url, count) == before


async def test_release_keeps_the_row_and_tokens_keep_rising(url: str) -> None:
    group = fresh()
    row_of = sql.SQL(
        "SELECT participant_id, token, expires_at FROM multilock_leases WHERE group_name = %s"
    )
    tokens = []
    async with PostgresProvider(url) as p:
        for participant in ["p1", "p2", "p1"]:
            info = await p.try_acquire(group, participant, 30, {})
            assert info is not None
            tokens.append(info.token)
            await p.release(group, participant, info.token)
            assert await query(url, row_of, group) == [(None, info.token, None)]
        short = await p.try_acquire(group, "p3", 0.3, {})
        assert short is not None
        tokens.append(short.token)
    # A new provider (new connections) after the lease expired still continues the count.
    async with PostgresProvider(url) as q:
        deadline = time.monotonic() + 5
        while await q.get_leader(group) is not None:
            assert time.monotonic() < deadline, "the short lease never expired"
            await asyncio.sleep(0.05)
        info = await q.try_acquire(group, "p3", 30, {})
        assert info is not None
        tokens.append(info.token)
    assert tokens == list(range(tokens[0], tokens[0] + 5)), tokens


async def test_a_live_term_is_refused_even_to_its_participant_id_and_nothing_is_written(
    url: str,
) -> None:
    # Two processes configured with one participant id, each with its own provider: the
    # second must not join (nor extend, nor relabel) the first one's term, or the election
    # could no longer tell its own term by the nonce in the metadata.
    group = fresh()
    channel = channel_name("public", "multilock_leases")
    # xmin changes with every new row version: equal means the row was not rewritten.
    row_of = sql.SQL(
        "SELECT xmin::text, participant_id, token, metadata, acquired_at, expires_at"
        " FROM multilock_leases WHERE group_name = %s"
    )
    async with (
        PostgresProvider(url) as p,
        PostgresProvider(url) as q,
        await psycopg.AsyncConnection.connect(url, autocommit=True) as listener,
    ):
        await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        first = await p.try_acquire(group, "p1", 30, {"multilock.instance": "a"})
        assert first is not None
        before = await query(url, row_of, group)
        assert await q.try_acquire(group, "p1", 60, {"multilock.instance": "b"}) is None
        assert await p.try_acquire(group, "p1", 60, {"multilock.instance": "a"}) is None
        assert await q.try_acquire(group, "p2", 60, {}) is None
        assert await query(url, row_of, group) == before, "a refused acquire wrote the row"
        assert await q.get_leader(group) == first
        # The refused statements have committed, so a marker sent now is queued after any
        # notification they sent: everything before it is theirs or the first acquire's.
        await query(url, sql.SQL("SELECT pg_notify(%s, 'marker')"), channel)
        payloads: list[str] = []
        async with asyncio.timeout(5):
            async for note in listener.notifies():
                if note.payload.split(" ")[0] in (group, "marker"):
                    payloads.append(note.payload)
                if note.payload == "marker":
                    break
        assert payloads == [f"{group} 30.0", "marker"], "a refused acquire sent a NOTIFY"
        # The holder takes its term up with renew, as the election does after a lost reply.
        assert await q.renew(group, "p1", first.token, 30, {"multilock.instance": "a"})
        await p.release(group, "p1", first.token)


async def test_twenty_racing_acquires_have_exactly_one_winner(url: str) -> None:
    # A fresh table: the 20 first calls also race to create it (pg_type unique violation).
    table = f"race_{uuid.uuid4().hex[:8]}"
    providers = [PostgresProvider(url, table=table) for _ in range(20)]
    try:
        for _round in range(5):
            group = fresh()
            results = await asyncio.gather(
                *(p.try_acquire(group, f"p{i}", 30, {}) for i, p in enumerate(providers))
            )
            winners = [r for r in results if r is not None]
            assert len(winners) == 1, f"{len(winners)} winners"
            leader = await providers[0].get_leader(group)
            assert leader is not None
            assert leader.participant_id == winners[0].participant_id
    finally:
        for p in providers:
            await p.aclose()
        await query(url, sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))


async def test_watch_wakes_on_release_within_100_ms(url: str) -> None:
    group = fresh()
    async with PostgresProvider(url) as p, PostgresProvider(url) as q:
        watch = q.watch(group)
        try:
            await next_within(watch, 5)  # subscribed
            delays = []
            for _ in range(5):
                info = await p.try_acquire(group, "p1", 30, {})
                assert info is not None
                await next_within(watch, 2)  # the acquisition is notified too
                started = time.monotonic()
                await p.release(group, "p1", info.token)
                await next_within(watch, 2)
                delays.append(time.monotonic() - started)
                assert await q.get_leader(group) is None
        finally:
            await watch.aclose()  # type: ignore[attr-defined]
    assert statistics.median(delays) < 0.1, delays
    assert max(delays) < 0.5, delays


async def connections_of(url: str, application: str) -> tuple[int, int]:
    """How many server connections *application* holds, and how many of them LISTEN."""
    rows = await query(
        url,
        sql.SQL(
            "SELECT count(*), count(*) FILTER (WHERE query LIKE 'LISTEN %%')"
            " FROM pg_stat_activity WHERE application_name = %s"
        ),
        application,
    )
    return rows[0][0], rows[0][1]


async def test_one_listen_connection_serves_every_watch_of_a_provider(url: str) -> None:
    # 50 groups watched, and 5 watches on one of them, all on one provider: the server
    # sees one LISTEN connection, and the statements stay within the provider's pool.
    application = fresh("watcher")
    groups = [fresh("many") for _ in range(50)]
    watched = f"{url}{'&' if '?' in url else '?'}application_name={application}"
    async with PostgresProvider(watched) as p, PostgresProvider(url) as writer:
        named = [(groups[0], p.watch(groups[0]))]
        pending: list[asyncio.Future[None]] = []
        try:
            await next_within(named[0][1], 5)
            assert await connections_of(url, application) in ((1, 1), (2, 1))
            named += [(g, p.watch(g)) for g in [*groups[1:], *[groups[0]] * 4]]
            await asyncio.gather(*(next_within(w, 10) for _, w in named[1:]))
            total, listening = await connections_of(url, application)
            assert listening == 1, f"{listening} LISTEN connections for {len(named)} watches"
            assert total <= MAX_CONNECTIONS + 1, f"{total} connections"
            same = [w for g, w in named if g == groups[0]]
            assert len(same) == 5
            info = await writer.try_acquire(groups[0], "p1", 30, {})
            assert info is not None
            await asyncio.gather(*(next_within(w, 2) for w in same))  # the acquisition
            pending = [asyncio.ensure_future(anext(w)) for _, w in named]
            woken = {
                g: [f for (h, _), f in zip(named, pending, strict=True) if h == g] for g in groups
            }
            assert await writer.renew(groups[0], "p1", info.token, 30, {})
            # A marker after the renewal: had the renewal notified, its wake came first.
            assert await writer.try_acquire(groups[1], "p2", 30, {}) is not None
            async with asyncio.timeout(2):
                await woken[groups[1]][0]
            await writer.get_leader(groups[0])  # one more round trip for any late wake
            assert not any(f.done() for f in woken[groups[0]]), "a renewal woke a watch"
            await writer.release(groups[0], "p1", info.token)
            async with asyncio.timeout(2):
                await asyncio.gather(*woken[groups[0]])
            await writer.get_leader(groups[0])
            others = [f for g in groups[2:] for f in woken[g]]
            assert not any(f.done() for f in others), "another group's watch woke"
            assert (await connections_of(url, application))[1] == 1
        finally:
            for future in pending:
                future.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for _, watch in named:
                await watch.aclose()  # type: ignore[attr-defined]
    # The last watch closed stops the listener; closing the provider closes the rest.
    async with asyncio.timeout(5):
        while await connections_of(url, application) != (0, 0):
            await asyncio.sleep(0.05)


async def test_watch_wakes_when_the_lease_expires(url: str) -> None:
    group = fresh()
    async with PostgresProvider(url) as p, PostgresProvider(url) as q:
        watch = q.watch(group)
        try:
            await next_within(watch, 5)
            acquired = time.monotonic()
            assert await p.try_acquire(group, "p1", 1.0, {}) is not None
            await next_within(watch, 2)  # the acquisition
            await next_within(watch, 3)  # the expiry
            woke = time.monotonic() - acquired
            assert 0.9 <= woke < 1.5, f"woke {woke:.3f} s after a 1 s lease began"
            assert await q.get_leader(group) is None, "woke before the server saw it expire"
        finally:
            await watch.aclose()  # type: ignore[attr-defined]


def row_reads(provider: PostgresProvider) -> list[str]:
    """The operations that read a lease's end through *provider* from now on, counted."""
    reads: list[str] = []
    query = provider._query

    async def counted(op: str, sql: Any, params: Any) -> Any:
        if sql is provider._sql.expires_in:
            reads.append(op)
        return await query(op, sql, params)

    provider._query = counted  # type: ignore[method-assign]
    return reads


async def test_a_leaders_renewals_spare_its_own_watch_the_expiry_reads(url: str) -> None:
    # A leader's own election watches its group too. Renewals notify nobody, so without a
    # note of them that watch would read the row once per lease, when the end it last
    # heard of came. A successful renewal notes the new end.
    async with PostgresProvider(url) as provider:
        reads = row_reads(provider)
        await lead_through(provider, fresh(), leases=3)
        assert len(reads) <= 1, f"the leader's watch read the row {len(reads)} times"


async def test_a_cancelled_renewal_notes_no_new_end(url: str) -> None:
    # A renewal cancelled while the server holds it (its outcome unknown) must not note
    # the end it asked for: the watches here would trust a lease the store may not have.
    # The next expiry question reads the row, and the provider serves the next call.
    group = fresh()
    async with PostgresProvider(url) as provider:
        info = await provider.try_acquire(group, "p1", 5.0, {})
        assert info is not None
        async with await psycopg.AsyncConnection.connect(url) as blocker:
            await blocker.execute(
                "SELECT 1 FROM multilock_leases WHERE group_name = %s FOR UPDATE", [group]
            )
            renewal = asyncio.ensure_future(provider.renew(group, "p1", info.token, 60.0, {}))
            deadline = time.monotonic() + 5
            while not await _waits_for_a_lock(url):
                assert time.monotonic() < deadline, "the renewal never waited for the row"
                assert not renewal.done(), renewal
                await asyncio.sleep(0.01)
            renewal.cancel()
            with pytest.raises(asyncio.CancelledError):
                await renewal
            await blocker.rollback()
        assert group not in provider._notified, "a cancelled renewal noted a new end"
        reads = row_reads(provider)
        left = await provider._expires_in(group)
        assert reads == ["watch"], "the expiry was answered without reading the row"
        assert left is not None, "the lease, live for 5 s, was not found"
        assert await provider.renew(group, "p1", info.token, 5.0, {}) is True


async def _waits_for_a_lock(url: str) -> bool:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE '%multilock_leases%'"
        )
        row = await cursor.fetchone()
        return row is not None and int(row[0]) > 0


async def test_renewals_of_one_loop_turn_share_one_statement(url: str) -> None:
    # 20 renewals asked for at once reach the server in one statement; one cancelled
    # before its turn ends is not sent, and one with a stale token is refused alone.
    groups = [fresh() for _ in range(20)]
    async with PostgresProvider(url) as provider:
        terms = await asyncio.gather(*(provider.try_acquire(g, "p1", 10.0, {}) for g in groups))
        tokens = [t.token for t in terms if t is not None]
        assert len(tokens) == 20
        statements: list[bytes] = []
        run = provider._connections.run

        async def counted(query: bytes, params: Any) -> Any:
            statements.append(query)
            return await run(query, params)

        provider._connections.run = counted  # type: ignore[method-assign]
        renewals = [
            asyncio.ensure_future(provider.renew(g, "p1", t + (i == 1), 30.0, {"n": str(i)}))
            for i, (g, t) in enumerate(zip(groups, tokens, strict=True))
        ]
        renewals[0].cancel()  # before the loop turn that sends them ends
        done = await asyncio.gather(*renewals[1:])
        assert done == [False] + [True] * 18
        assert renewals[0].cancelled()
        assert statements == [provider._sql.renew_many], "not one statement for the turn"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cursor = await conn.execute(
            "SELECT group_name, extract(epoch FROM expires_at - clock_timestamp()), metadata"
            " FROM multilock_leases WHERE group_name = ANY(%s)",
            [groups],
        )
        rows = {g: (left, meta) for g, left, meta in await cursor.fetchall()}
    assert rows[groups[0]][0] <= 10, "cancelled: not sent"
    assert rows[groups[1]][0] <= 10, "a stale token: refused"
    assert min(rows[g][0] for g in groups[2:]) > 10, "renewed to 30 s"
    assert [rows[g][1] for g in groups[2:]] == [{"n": str(i)} for i in range(2, 20)]


def batches_sent(provider: PostgresProvider, kind: str) -> list[tuple[str, list[str]]]:
    """Record the *kind* statements (acquire, renew, release) *provider* runs from now on, each
    as ("one", [group]) on plain values or ("many", groups) over arrays."""
    statements: list[tuple[str, list[str]]] = []
    one, many = getattr(provider._sql, kind), getattr(provider._sql, f"{kind}_many")
    run = provider._connections.run

    async def counted(query: bytes, params: Any) -> Any:
        if query == one:
            statements.append(("one", [params["group"]]))
        elif query == many:
            statements.append(("many", list(params["group"])))
        return await run(query, params)

    provider._connections.run = counted  # type: ignore[method-assign]
    return statements


async def test_a_lone_renewal_goes_on_plain_values(url: str) -> None:
    # A leader's renewal is mostly alone in its loop turn: it runs the statement on plain
    # values, with the same answers as the one over arrays (a stale token, another
    # participant and a lapsed lease are refused; the metadata is written).
    g, lapsed = fresh(), fresh()
    async with PostgresProvider(url) as provider:
        term = await provider.try_acquire(g, "p1", 10.0, {})
        short = await provider.try_acquire(lapsed, "p1", 0.05, {})
        assert term is not None
        assert short is not None
        statements = batches_sent(provider, "renew")
        assert await provider.renew(g, "p1", term.token, 30.0, {"n": "1"})
        assert not await provider.renew(g, "p1", term.token + 1, 30.0, {})
        assert not await provider.renew(g, "p2", term.token, 30.0, {})
        async with asyncio.timeout(5):
            while await provider.get_leader(lapsed) is not None:
                await asyncio.sleep(0.05)  # the lease runs out on the server's clock
        assert not await provider.renew(lapsed, "p1", short.token, 30.0, {})
        assert statements == [("one", [g])] * 3 + [("one", [lapsed])]
        leader = await provider.get_leader(g)
        assert leader is not None
        assert (leader.token, leader.metadata) == (term.token, {"n": "1"})
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cursor = await conn.execute(
            "SELECT extract(epoch FROM expires_at - clock_timestamp()) FROM multilock_leases"
            " WHERE group_name = %s",
            [g],
        )
        row = await cursor.fetchone()
    assert row is not None
    assert 20 < row[0] <= 30, "renewed to 30 s"


async def test_releases_asked_for_while_one_is_on_its_way_share_one_statement(
    url: str,
) -> None:
    # A process stopping with many groups: the first release goes at once, alone; the 19
    # asked for while it is on its way go together after it, each by its own token (a
    # stale one releases nothing), and every group released is notified.
    groups = [fresh() for _ in range(20)]
    async with PostgresProvider(url) as provider:
        terms = await asyncio.gather(*(provider.try_acquire(g, "p1", 30.0, {}) for g in groups))
        tokens = [t.token for t in terms if t is not None]
        assert len(tokens) == 20
        watch = provider.watch(groups[0])
        await next_within(watch, 5)
        statements = batches_sent(provider, "release")
        releases = [
            asyncio.ensure_future(provider.release(g, "p1", t + (i == 1)))
            for i, (g, t) in enumerate(zip(groups, tokens, strict=True))
        ]
        await asyncio.gather(*releases)
        # The batch's rows go in group order (two batches lock shared rows alike).
        expected = [("one", groups[:1]), ("many", sorted(groups[1:]))]
        assert statements == expected, "not the first alone, then the rest in group order"
        await next_within(watch, 2)  # the first group's release was notified
        leaders = await asyncio.gather(*(provider.get_leader(g) for g in groups))
        assert leaders[1] is not None, "a stale token released the group"
        assert [leader for i, leader in enumerate(leaders) if i != 1] == [None] * 19
        await watch.aclose()


async def test_acquires_asked_for_while_one_is_on_its_way_share_one_statement(
    url: str,
) -> None:
    # A process starting many elections: the first acquire goes at once, alone; those
    # asked for while it is on its way go together after it, in one statement, in group
    # order, each group once. A second ask for a group in the same batch gets None, as it
    # would right after the first; a group led elsewhere is neither taken nor notified.
    groups = [fresh() for _ in range(20)]
    channel = channel_name("public", "multilock_leases")
    async with (
        PostgresProvider(url) as provider,
        PostgresProvider(url) as other,
        await psycopg.AsyncConnection.connect(url, autocommit=True) as listener,
    ):
        held = await other.try_acquire(groups[3], "elsewhere", 30.0, {})
        assert held is not None
        await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        statements = batches_sent(provider, "acquire")
        asks = [(g, "p1") for g in groups] + [(groups[7], "p2")]
        terms = await asyncio.gather(
            *(provider.try_acquire(g, who, 30.0, {"who": who}) for g, who in asks)
        )
        expected = [("one", groups[:1]), ("many", sorted(groups[1:]))]
        assert statements == expected, "not the first alone, then the rest in group order"
        won = {g: term for (g, _), term in zip(asks, terms, strict=True) if term is not None}
        assert sorted(won) == sorted(g for g in groups if g != groups[3])
        assert terms[-1] is None, "a second ask for a group in one batch took it too"
        for group, term in won.items():
            assert (term.participant_id, term.metadata) == ("p1", {"who": "p1"})
            assert await other.get_leader(group) == term
        assert await other.get_leader(groups[3]) == held
        await query(url, sql.SQL("SELECT pg_notify(%s, 'marker')"), channel)
        payloads: list[str] = []
        async with asyncio.timeout(5):
            async for note in listener.notifies():
                if note.payload == "marker":
                    break
                payloads.append(note.payload)
        assert sorted(payloads) == sorted(f"{g} 30.0" for g in won), "not one NOTIFY per term"


async def test_statement_timeout_bounds_a_blocked_call(url: str) -> None:
    group = fresh()
    async with PostgresProvider(url, statement_timeout=0.5) as p:
        info = await p.try_acquire(group, "p1", 30, {})
        assert info is not None
        async with await psycopg.AsyncConnection.connect(url) as blocker:
            await blocker.execute(
                "SELECT 1 FROM multilock_leases WHERE group_name = %s FOR UPDATE", [group]
            )
            started = time.monotonic()
            with pytest.raises(ProviderError) as err:
                await p.renew(group, "p1", info.token, 30, {})
            assert time.monotonic() - started < 2.0
            assert isinstance(err.value.__cause__, psycopg.errors.QueryCanceled)
            await blocker.rollback()
        assert await p.renew(group, "p1", info.token, 30, {})


@pytest.mark.parametrize("autocommit", [True, False])
async def test_a_callers_connection_is_used_and_left_open(url: str, autocommit: bool) -> None:
    group = fresh()
    async with await psycopg.AsyncConnection.connect(url, autocommit=autocommit) as conn:
        p = PostgresProvider(conn)
        info = await p.try_acquire(group, "p1", 30, {"k": "v"})
        assert info is not None
        leader = await p.get_leader(group)
        assert leader is not None
        assert leader.token == info.token
        watch = p.watch(group)  # on a connection of its own, built from this one's
        try:
            await next_within(watch, 5)
            await p.release(group, "p1", info.token)
            await next_within(watch, 2)
        finally:
            await watch.aclose()  # type: ignore[attr-defined]
        await p.aclose()
        assert not conn.closed
        assert conn.info.transaction_status == TransactionStatus.IDLE
        await conn.execute("SELECT 1")


async def test_a_callers_pool_is_used_and_left_open(url: str) -> None:
    from psycopg_pool import AsyncConnectionPool

    group = fresh()
    async with AsyncConnectionPool(url, min_size=1, max_size=4, open=False) as pool:
        p = PostgresProvider(pool)
        results = await asyncio.gather(*(p.try_acquire(group, f"p{i}", 30, {}) for i in range(8)))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1
        watch = p.watch(group)
        try:
            await next_within(watch, 5)
            await p.release(group, winners[0].participant_id, winners[0].token)
            await next_within(watch, 2)
        finally:
            await watch.aclose()  # type: ignore[attr-defined]
        await p.aclose()
        assert not pool.closed
        async with pool.connection() as conn:
            await conn.execute("SELECT 1")


async def test_server_restart_fails_fast_then_recovers(postgres_server: BaseServer) -> None:
    server = require_control(postgres_server)
    group = fresh()
    p = PostgresProvider(server.url, connect_timeout=2, statement_timeout=2)
    watch = p.watch(group)
    pending: asyncio.Future[None] | None = None
    try:
        info = await p.try_acquire(group, "p1", 60, {})
        assert info is not None
        await next_within(watch, 5)
        pending = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0.1)  # the watch is waiting on its connection
        await asyncio.to_thread(server.stop)

        with pytest.raises(ProviderError):
            async with asyncio.timeout(5):
                await pending
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "get_leader": lambda: p.get_leader(group),
            "try_acquire": lambda: p.try_acquire(group, "p2", 60, {}),
            "renew": lambda: p.renew(group, "p1", info.token, 60, {}),
            "release": lambda: p.release(group, "p1", info.token),
        }
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(ProviderError):
                await call()
            assert time.monotonic() - started < 3.0, f"{name} took too long to fail"
        with pytest.raises(ProviderError):
            await anext(p.watch(group))

        await asyncio.to_thread(server.start)
        # The first call after the restart works: dead connections were dropped.
        leader = await p.get_leader(group)
        assert leader is not None
        assert (leader.participant_id, leader.token) == ("p1", info.token)
        assert await p.renew(group, "p1", info.token, 60, {})
        await p.release(group, "p1", info.token)
        again = await p.try_acquire(group, "p2", 60, {})
        assert again is not None
        assert again.token > info.token
        fresh_watch = p.watch(group)
        try:
            await next_within(fresh_watch, 5)
            await p.release(group, "p2", again.token)
            await next_within(fresh_watch, 2)
        finally:
            await fresh_watch.aclose()  # type: ignore[attr-defined]
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        await watch.aclose()  # type: ignore[attr-defined]
        if not getattr(server, "running", True):
            await asyncio.to_thread(server.start)
        await p.aclose()


async def test_first_calls_after_a_quiet_restart_succeed(postgres_server: BaseServer) -> None:
    # No call fails while the server is down, so the provider still holds idle connections
    # to the old server process: each call finds its connection dead and retries once.
    server = require_control(postgres_server)
    group = fresh()
    async with PostgresProvider(server.url, connect_timeout=2, statement_timeout=2) as p:
        info = await p.try_acquire(group, "p1", 60, {})
        assert info is not None
        await asyncio.gather(*(p.get_leader(group) for _ in range(3)))  # idle connections
        try:
            await asyncio.to_thread(server.restart)
        finally:
            if not getattr(server, "running", True):
                await asyncio.to_thread(server.start)
        leaders = await asyncio.gather(*(p.get_leader(group) for _ in range(3)))
        assert all(leader is not None and leader.token == info.token for leader in leaders)
        assert await p.renew(group, "p1", info.token, 60, {})
        await p.release(group, "p1", info.token)
