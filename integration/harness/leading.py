"""Elections run to a point, each wait bounded by a deadline, for the integration tests."""

from __future__ import annotations

import asyncio
import time

from multilock.core import LeaderElection
from multilock.core.provider import Provider

__all__ = ["lead_through", "renewed"]


async def renewed(election: LeaderElection, times: int, within: float) -> None:
    """Wait until *election* has renewed its lease *times* times, still leading; else fail."""
    deadline = time.monotonic() + within
    while election.statistics().renewals < times:
        assert time.monotonic() < deadline, f"the leader did not renew {times} times in {within} s"
        await asyncio.sleep(0.05)
    assert election.is_leader, "the election lost its term while renewing"


async def lead_through(provider: Provider, group: str, leases: int, lease: float = 1.0) -> None:
    """Lead *group* on *provider* for *leases* leases (three renewals each), then stop."""
    election = LeaderElection(provider, group=group, participant_id="a", lease_duration=lease)
    async with election:
        await election.wait_until_leader(timeout=10)
        await renewed(election, 3 * leases, within=10 * leases * lease)
