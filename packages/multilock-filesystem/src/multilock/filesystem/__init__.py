"""multilock.filesystem: leader election among the processes of one machine, through files.

`FileSystemProvider` keeps one lease record per group in a directory and guards every
read-check-write with a cross-process file lock. URL form: ``file:///absolute/path``.
"""

from ._provider import FileSystemProvider

__all__ = ["FileSystemProvider"]
