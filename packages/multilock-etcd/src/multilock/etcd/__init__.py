"""etcd provider for multilock: one key per group, attached to a lease, taken by a txn."""

from ._provider import EtcdProvider

__all__ = ["EtcdProvider"]
