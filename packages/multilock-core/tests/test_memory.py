import threading

import pytest

from multilock.core import InMemoryProvider
from multilock.core.testing import PROVIDER_CHECKS, FakeClock, check_provider


@pytest.mark.parametrize("check", list(PROVIDER_CHECKS))
def test_contract_in_virtual_time(check):
    clock = FakeClock()
    clock.run(
        check_provider(
            lambda: InMemoryProvider(clock=clock.monotonic, store_name="contract"),
            lease_duration=5.0,
            only=check,
        )
    )


def test_contract_catches_a_broken_provider():
    """The kit itself must be able to fail: a provider that never expires leases."""

    class NeverExpires(InMemoryProvider):
        async def get_leader(self, group):
            lease = self._store.leases.get(group)
            return None if lease is None else lease.info

    clock = FakeClock()
    with pytest.raises(AssertionError, match="expiry_frees_the_group"):
        clock.run(
            check_provider(
                lambda: NeverExpires(clock=clock.monotonic, store_name="broken"),
                lease_duration=1.0,
                only="expiry_frees_the_group",
            )
        )


def test_stores_are_safe_across_threads():
    provider = InMemoryProvider()
    winners = []
    barrier = threading.Barrier(8)

    def contend(i):
        import asyncio

        barrier.wait()
        info = asyncio.run(provider.try_acquire("threads", f"p{i}", 30, {}))
        if info is not None:
            winners.append(info)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(winners) == 1


def test_repr_names_the_store():
    assert "store_name='x'" in repr(InMemoryProvider(store_name="x"))
    assert repr(InMemoryProvider()) == "<InMemoryProvider>"
