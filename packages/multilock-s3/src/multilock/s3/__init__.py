"""multilock.s3: leader election on one S3 object per group, with conditional writes."""

from ._provider import S3Provider

__all__ = ["S3Provider"]
