"""`contenders`: who campaigns for a group, the leader first, as kazoo's ``Election.contenders()``.

Only a store that records every candidate can say (ZooKeeper, where each one holds a
node); on the others the provider raises `UnsupportedOperation` at once, naming itself
and why, rather than answering with the leader alone as if nobody followed.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from ._calls import call_until
from ._errors import ProviderError
from ._failures import FailureReason
from ._names import to_seconds
from ._provider import Provider

__all__ = ["contenders"]


async def contenders(
    provider: Provider,
    group: str,
    *,
    timeout: float | timedelta = 10.0,  # noqa: ASYNC109 (the error message names it)
) -> tuple[str, ...]:
    """Ask the store for the participant ids of *group*'s live candidates, within *timeout*.

    The leader comes first, then the others in the order they would lead; the tuple is
    empty when nobody campaigns. It is a snapshot: candidates come and go right after.
    Raises `UnsupportedOperation` on a store that records only the leader,
    `ConfigurationError` for an invalid *group* or *timeout*, and `ProviderError` when
    the store fails or does not answer within *timeout* seconds.
    """
    seconds = to_seconds(timeout, "timeout")
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        return tuple(await call_until(provider.contenders(group), deadline))
    except TimeoutError:
        error = ProviderError(
            f"contenders({group!r}) did not answer within {seconds:g} s",
            reason=FailureReason.TIMEOUT,
        )
    raise error  # outside the handler: the TimeoutError is not chained
