"""multilock.sqlserver: leader election on a SQL Server table, through pyodbc."""

from ._provider import SqlServerProvider

__all__ = ["SqlServerProvider"]
