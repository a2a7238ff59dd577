"""The SQL of `PostgresProvider`: the identifier check, the channel and the statements.

Every statement is built once per (schema, table) with `psycopg.sql.Identifier` and kept as
bytes (nothing to compose per call; psycopg prepares a statement after a few runs on a
connection), and every value (group, participant, token, lease, metadata) is a bound
parameter. Time is always the server's ``clock_timestamp()``, read once per statement
(``FROM (SELECT clock_timestamp() AS now)``), never the client's clock: in autocommit
``now()`` would do too, but ``clock_timestamp()`` stays right even on a connection inside
a transaction.

Notifications: one channel per table (`channel_name`). A taken lease sends
``"<group> <lease seconds>"``, a release sends ``"<group>"``, both from the statement that
writes the row (delivered at its commit); a renewal sends nothing.
"""

from __future__ import annotations

import hashlib
from typing import LiteralString

from psycopg import sql

from multilock.core.provider import validate_identifier as _validate_identifier

__all__ = ["Statements", "channel_name", "validate_identifier"]

#: PostgreSQL truncates identifiers to 63 bytes; ASCII only, so characters are bytes.


def validate_identifier(value: object, field: str) -> str:
    """A schema or table name PostgreSQL accepts unquoted (63 bytes, no ``pg_`` schema)."""
    reserved = ("pg_",) if field == "schema" else ()
    return _validate_identifier(value, field, max_length=63, reserved_prefixes=reserved)


def channel_name(schema: str, table: str) -> str:
    """The LISTEN/NOTIFY channel of a table: a hash, so any names fit in 63 bytes."""
    digest = hashlib.sha256(f"{schema}\0{table}".encode()).hexdigest()
    return f"multilock_{digest[:40]}"


class Statements:
    """The statements for one table, composed once."""

    def __init__(self, schema: str, table: str) -> None:
        names = {
            "s": sql.Identifier(schema),
            "t": sql.Identifier(schema, table),
            "channel": sql.Identifier(channel_name(schema, table)),
            "to": sql.Literal(channel_name(schema, table)),
        }

        def q(text: LiteralString) -> bytes:
            return sql.SQL(text).format(**names).as_bytes(None)

        self.exists = q(
            "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %(schema)s), "
            "EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = %(schema)s "
            "AND tablename = %(table)s)"
        )
        self.create_schema = q("CREATE SCHEMA IF NOT EXISTS {s}")
        self.create_table = q(
            "CREATE TABLE IF NOT EXISTS {t} ("
            " group_name text PRIMARY KEY,"
            " participant_id text,"
            " token bigint NOT NULL,"
            " metadata jsonb NOT NULL DEFAULT '{{}}'::jsonb,"
            " acquired_at timestamptz,"
            " expires_at timestamptz)"
        )
        # Batches (`Batches`) go as one statement over arrays, each array parameter named
        # as the value it holds; a batch of one, such as a handoff's acquire and release,
        # goes as the same statement on plain values, which the server runs in about
        # 0.1 ms (acquire) and 0.2 ms (release) less.
        #
        # Acquire: insert the first term, or take over a free or expired row with token +
        # 1. A live row is never taken, whoever holds it (even the same participant id):
        # the WHERE refuses it, so nothing is written or returned for it, and only a row
        # taken is notified (at commit), with its payload. A batch takes each group once
        # (a statement can take a row only once), its rows in the order given (the
        # provider sorts them by group, so two batches lock shared rows in one order and
        # cannot deadlock).
        taken = (
            " ON CONFLICT (group_name) DO UPDATE SET"
            " token = t.token + 1,"
            " participant_id = excluded.participant_id,"
            " metadata = excluded.metadata,"
            " acquired_at = excluded.acquired_at,"
            " expires_at = excluded.expires_at"
            " WHERE t.participant_id IS NULL OR t.expires_at <= excluded.acquired_at"
        )
        self.acquire = q(
            "INSERT INTO {t} AS t"
            " (group_name, participant_id, token, metadata, acquired_at, expires_at)"
            " SELECT %(group)s::text, %(participant)s::text, 1, %(metadata)s::jsonb,"
            " c.now, c.now + make_interval(secs => %(lease)s)"
            " FROM (SELECT clock_timestamp() AS now) AS c"
            + taken
            + " RETURNING t.group_name, t.token, t.acquired_at,"
            " pg_notify({to}, %(payload)s)::text"
        )
        self.acquire_many = q(
            "WITH r AS (SELECT * FROM unnest(%(group)s::text[], %(participant)s::text[],"
            " %(lease)s::float8[], %(metadata)s::text[], %(payload)s::text[])"
            " WITH ORDINALITY AS r(group_name, participant_id, lease, metadata, payload, n)),"
            " taken AS (INSERT INTO {t} AS t"
            " (group_name, participant_id, token, metadata, acquired_at, expires_at)"
            " SELECT r.group_name, r.participant_id, 1, r.metadata::jsonb,"
            " c.now, c.now + make_interval(secs => r.lease)"
            " FROM (SELECT clock_timestamp() AS now) AS c, r ORDER BY r.n"
            + taken
            + " RETURNING t.group_name, t.token, t.acquired_at)"
            " SELECT taken.group_name, taken.token, taken.acquired_at,"
            " pg_notify({to}, r.payload)::text FROM taken JOIN r USING (group_name)"
        )
        # The renewals one loop turn asked for, in one statement (`Batches`): the same
        # condition for each (its participant, its token, a live lease), one clock reading.
        # A leader's own renewal is mostly alone: a batch of one goes on plain values.
        self.renew = q(
            "UPDATE {t} AS t SET expires_at = c.now + make_interval(secs => %(lease)s),"
            " metadata = %(metadata)s::jsonb"
            " FROM (SELECT clock_timestamp() AS now) AS c"
            " WHERE t.group_name = %(group)s AND t.participant_id = %(participant)s"
            " AND t.token = %(token)s AND t.expires_at > c.now"
            " RETURNING t.group_name, t.participant_id, t.token"
        )
        self.renew_many = q(
            "UPDATE {t} AS t SET expires_at = c.now + make_interval(secs => r.lease),"
            " metadata = r.metadata::jsonb"
            " FROM (SELECT clock_timestamp() AS now) AS c,"
            " unnest(%(group)s::text[], %(participant)s::text[], %(token)s::bigint[],"
            " %(lease)s::float8[], %(metadata)s::text[])"
            " AS r(group_name, participant_id, token, lease, metadata)"
            " WHERE t.group_name = r.group_name AND t.participant_id = r.participant_id"
            " AND t.token = r.token AND t.expires_at > c.now"
            " RETURNING t.group_name, t.participant_id, t.token"
        )
        # Release, each row by its participant and token. The row and its token stay, so
        # the next term's token is still token + 1.
        self.release = q(
            "WITH released AS ("
            " UPDATE {t} SET participant_id = NULL, expires_at = NULL, acquired_at = NULL,"
            " metadata = '{{}}'::jsonb"
            " WHERE group_name = %(group)s AND participant_id = %(participant)s"
            " AND token = %(token)s RETURNING group_name)"
            " SELECT pg_notify({to}, group_name)::text FROM released"
        )
        self.release_many = q(
            "WITH released AS ("
            " UPDATE {t} AS t SET participant_id = NULL, expires_at = NULL,"
            " acquired_at = NULL, metadata = '{{}}'::jsonb"
            " FROM unnest(%(group)s::text[], %(participant)s::text[], %(token)s::bigint[])"
            " AS r(group_name, participant_id, token)"
            " WHERE t.group_name = r.group_name AND t.participant_id = r.participant_id"
            " AND t.token = r.token RETURNING t.group_name)"
            " SELECT pg_notify({to}, group_name)::text FROM released"
        )
        self.leader = q(
            "SELECT participant_id, token, metadata, acquired_at FROM {t}"
            " WHERE group_name = %(group)s AND participant_id IS NOT NULL"
            " AND expires_at > clock_timestamp()"
        )
        self.expires_in = q(
            "SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 FROM {t}"
            " WHERE group_name = %(group)s AND participant_id IS NOT NULL"
            " AND expires_at > clock_timestamp()"
        )
        self.listen = q("LISTEN {channel}")
