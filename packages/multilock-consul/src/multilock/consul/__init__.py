"""multilock.consul: leader election on Consul sessions and KV locks, with blocking queries."""

from ._provider import ConsulProvider

__all__ = ["ConsulProvider"]
