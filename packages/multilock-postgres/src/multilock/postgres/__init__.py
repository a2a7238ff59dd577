"""multilock.postgres: leader election on a PostgreSQL table, with LISTEN/NOTIFY wake-ups."""

from ._provider import PostgresProvider

__all__ = ["PostgresProvider"]
