"""multilock.redis: leader election on Redis (`RedisProvider`) and on a majority of
independent Redis servers (`RedlockProvider`).

    from multilock.core import LeaderElection
    from multilock.redis import RedisProvider

    async with RedisProvider("redis://localhost:6379/0") as provider:
        async with LeaderElection(provider, group="nightly-report") as election:
            await election.run_while_leader(report_loop)
"""

from ._provider import RedisProvider
from ._redlock import RedlockProvider

__all__ = ["RedisProvider", "RedlockProvider"]
