"""multilock.zookeeper: leader election on ZooKeeper candidate nodes, through kazoo."""

from ._provider import ZooKeeperProvider

__all__ = ["ZooKeeperProvider"]
