"""A renew that is slow to settle its cancellation must not hold up the step-down."""

import asyncio
import contextlib

from multilock.core import EventKind, InMemoryProvider, LeaderElection
from multilock.core.testing import FakeClock

LEASE = 10.0


class SlowToCancel(InMemoryProvider):
    """Renews hang once ``stuck`` is set, and take 30 s to settle a cancellation."""

    stuck = False

    async def renew(self, *args, **kwargs):
        if self.stuck:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(30)  # like psycopg cancelling the query on the server
                raise
        return await super().renew(*args, **kwargs)


def test_a_renew_slow_to_cancel_still_ends_the_term_at_its_deadline():
    clock = FakeClock()

    async def main():
        provider = SlowToCancel(clock=clock.monotonic)
        election = LeaderElection(provider, group="g", participant_id="a", lease_duration=LEASE)
        events = election.events(EventKind.LOST)
        await election.start()
        leadership = await election.wait_until_leader()
        provider.stuck = True
        lost = await anext(events)
        assert lost.token == leadership.token
        late = asyncio.get_running_loop().time() - leadership.deadline
        assert late < 0.1, f"LOST came {late:.3f} s after the deadline"
        provider.stuck = False
        await election.stop()

    clock.run(main())


class SwallowsCancel(InMemoryProvider):
    """Once ``stuck``, a renew swallows the first cancel, as 3.11's wait_for can."""

    stuck = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.entered = asyncio.Event()

    async def renew(self, *args, **kwargs):
        if self.stuck:
            self.stuck = False
            self.entered.set()
            # The inner call finished just as the cancel landed: its result wins.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)
        return await super().renew(*args, **kwargs)


def test_stop_survives_a_driver_that_swallows_a_cancel():
    clock = FakeClock()

    async def main():
        provider = SwallowsCancel(clock=clock.monotonic)
        election = LeaderElection(provider, group="g", participant_id="a", lease_duration=LEASE)
        await election.start()
        await election.wait_until_leader()
        provider.stuck = True
        await provider.entered.wait()
        async with asyncio.timeout(60):  # virtual time: without a second cancel, forever
            await election.stop()
        assert not election.is_leader

    clock.run(main())


def test_the_election_campaigns_again_without_waiting_for_the_settle():
    """The cancelled renew settles in the background (30 s here): the next term comes first."""
    clock = FakeClock()

    async def main():
        provider = SlowToCancel(clock=clock.monotonic)
        election = LeaderElection(provider, group="g", participant_id="a", lease_duration=LEASE)
        events = election.events(EventKind.LOST)
        await election.start()
        first = await election.wait_until_leader()
        provider.stuck = True
        await anext(events)
        lost_at = asyncio.get_running_loop().time()
        provider.stuck = False
        second = await election.wait_until_leader()
        again = asyncio.get_running_loop().time() - lost_at
        assert second.token > first.token
        assert again < 10, f"the next term came {again:.1f} s after LOST (the settle takes 30 s)"
        await election.stop()

    clock.run(main())
