"""The T-SQL of `SqlServerProvider`: identifier checks, quoting and the statements.

Schema and table names are checked against a strict pattern, then bracket-quoted (``]``
doubled) wherever they appear; every value (group, participant, token, lease, metadata)
is a bound ``?`` parameter. Time is only ever the server's ``SYSUTCDATETIME()``, read
once per statement in a derived table. Each write is one statement that reads the row
``WITH (UPDLOCK, HOLDLOCK)``: the update lock plus a key-range lock held to the end of
the statement, so two sessions can neither both see "free" nor both insert the first row.
"""

from __future__ import annotations

from multilock.core.provider import validate_identifier as _validate_identifier

__all__ = ["Statements", "quote_identifier", "validate_identifier"]

#: SQL Server identifiers are at most 128 characters; ASCII only, on purpose.
#: Microseconds from the Unix epoch: the same integer from every ODBC driver.
_EPOCH_US = "DATEDIFF_BIG(microsecond, CAST('1970-01-01' AS datetime2(7)), {})"


def validate_identifier(value: object, field: str) -> str:
    """A schema or table name of at most 128 characters (SQL Server's sysname)."""
    return _validate_identifier(value, field, max_length=128)


def quote_identifier(name: str) -> str:
    """``[name]``, with ``]`` doubled: safe even for names the pattern would refuse."""
    return "[" + name.replace("]", "]]") + "]"


def _literal(text: str) -> str:
    """An ``N'...'`` literal of *text* (for DDL run through ``EXEC``)."""
    return "N'" + text.replace("'", "''") + "'"


class Statements:
    """The statements for one table, built once from its checked names."""

    def __init__(self, schema: str, table: str) -> None:
        s = quote_identifier(schema)
        t = f"{s}.{quote_identifier(table)}"
        self.table = t
        create_schema = _literal(f"CREATE SCHEMA {s}")
        create_table = _literal(
            f"CREATE TABLE {t} ("
            " group_name nvarchar(255) COLLATE Latin1_General_BIN2 NOT NULL PRIMARY KEY,"
            " participant_id nvarchar(255) COLLATE Latin1_General_BIN2 NULL,"
            " token bigint NOT NULL,"
            " metadata nvarchar(max) NOT NULL,"
            " acquired_at datetime2(7) NULL,"
            " expires_at datetime2(7) NULL)"
        )
        # Params: schema name, quoted table name. Existence is checked first, so a login
        # without CREATE rights works on a table made in advance; a create that loses a
        # race with another process is fine as long as the object exists afterwards.
        self.setup = (
            "SET NOCOUNT ON;"
            " DECLARE @schema sysname = ?, @table nvarchar(300) = ?;"
            " IF SCHEMA_ID(@schema) IS NULL BEGIN"
            f" BEGIN TRY EXEC({create_schema}); END TRY"
            " BEGIN CATCH IF SCHEMA_ID(@schema) IS NULL THROW; END CATCH"
            " END;"
            " IF OBJECT_ID(@table, N'U') IS NULL BEGIN"
            f" BEGIN TRY EXEC({create_table}); END TRY"
            " BEGIN CATCH IF OBJECT_ID(@table, N'U') IS NULL THROW; END CATCH"
            " END;"
        )
        # Params: group, participant, metadata, lease seconds, lease microseconds.
        # Takes the row if free or expired (token + 1, a new term) or inserts the first
        # term (token 1). A live row matches no branch, whoever holds it (even the same
        # participant id): nothing is written and nothing is output.
        expires = "DATEADD(microsecond, s.lease_us, DATEADD(second, s.lease_s, s.now))"
        self.acquire = (
            f"MERGE {t} WITH (UPDLOCK, HOLDLOCK) AS t"
            " USING (SELECT CAST(? AS nvarchar(255)) AS group_name,"
            " CAST(? AS nvarchar(255)) AS participant_id, CAST(? AS nvarchar(max)) AS metadata,"
            " CAST(? AS int) AS lease_s, CAST(? AS int) AS lease_us,"
            " SYSUTCDATETIME() AS now) AS s"
            " ON t.group_name = s.group_name"
            " WHEN MATCHED AND (t.participant_id IS NULL OR t.expires_at <= s.now)"
            " THEN UPDATE SET token = t.token + 1, acquired_at = s.now,"
            " participant_id = s.participant_id, metadata = s.metadata,"
            f" expires_at = {expires}"
            " WHEN NOT MATCHED THEN INSERT"
            " (group_name, participant_id, token, metadata, acquired_at, expires_at)"
            f" VALUES (s.group_name, s.participant_id, 1, s.metadata, s.now, {expires})"
            f" OUTPUT inserted.token, {_EPOCH_US.format('inserted.acquired_at')};"
        )
        # Params: lease seconds, lease microseconds, metadata, group, participant, token.
        self.renew = (
            "UPDATE t SET expires_at = DATEADD(microsecond, s.lease_us,"
            " DATEADD(second, s.lease_s, s.now)), metadata = s.metadata"
            " OUTPUT inserted.token"
            f" FROM {t} AS t WITH (UPDLOCK, HOLDLOCK)"
            " CROSS JOIN (SELECT CAST(? AS int) AS lease_s, CAST(? AS int) AS lease_us,"
            " CAST(? AS nvarchar(max)) AS metadata, SYSUTCDATETIME() AS now) AS s"
            " WHERE t.group_name = ? AND t.participant_id = ? AND t.token = ?"
            " AND t.expires_at > s.now;"
        )
        # Params: group, participant, token. The row and its token stay, so the next
        # term's token is still token + 1.
        self.release = (
            "UPDATE t SET participant_id = NULL, metadata = N'{}',"
            " acquired_at = NULL, expires_at = NULL"
            " OUTPUT inserted.token"
            f" FROM {t} AS t WITH (UPDLOCK, HOLDLOCK)"
            " WHERE t.group_name = ? AND t.participant_id = ? AND t.token = ?;"
        )
        # Params: group. Only a live lease, by the server's clock.
        self.leader = (
            f"SELECT participant_id, token, metadata, {_EPOCH_US.format('acquired_at')}"
            f" FROM {t} WHERE group_name = ? AND participant_id IS NOT NULL"
            " AND expires_at > SYSUTCDATETIME();"
        )
