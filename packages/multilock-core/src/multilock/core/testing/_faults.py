"""`FaultyProvider`: wrap a provider and make its calls hang, fail or lie, on demand."""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence

from .._errors import ProviderError
from .._provider import LeaseBounds, Provider
from .._types import LeaderInfo

__all__ = ["Fault", "FaultyProvider"]


class Fault(enum.Enum):
    """What a faulty call does instead of its job."""

    #: Never answer (a partition or a stuck server); cancellation still works.
    HANG = "hang"
    #: Raise `ProviderError` at once (a broken connection).
    RAISE = "raise"
    #: Answer "not yours" (renew False, try_acquire None) without touching the store.
    REFUSE = "refuse"


_METHODS = frozenset({"try_acquire", "renew", "release", "get_leader", "watch", "contenders"})


class FaultyProvider(Provider):
    """Delegate to *inner* until a fault is set with `inject`; count every call."""

    def __init__(self, inner: Provider) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self._faults: dict[str, Fault] = {}
        self._healed = asyncio.Event()

    def inject(self, fault: Fault, *methods: str) -> None:
        """Make *methods* (default: all, including watch) misbehave as *fault* says."""
        unknown = set(methods) - _METHODS
        if unknown:
            raise ValueError(f"unknown method(s): {sorted(unknown)}")
        for method in methods or _METHODS:
            self._faults[method] = fault
        self._healed = asyncio.Event()

    def heal(self) -> None:
        """Remove every fault; hung watches resume."""
        self._faults.clear()
        self._healed.set()

    async def _gate(self, method: str) -> Fault | None:
        self.calls[method] += 1
        fault = self._faults.get(method)
        if fault is Fault.HANG:
            await asyncio.Event().wait()
        if fault is Fault.RAISE:
            raise ProviderError(f"injected failure in {method}") from ConnectionError("cut")
        return fault

    async def try_acquire(
        self, group: str, participant_id: str, lease_duration: float, metadata: Mapping[str, str]
    ) -> LeaderInfo | None:
        if await self._gate("try_acquire") is Fault.REFUSE:
            return None
        return await self.inner.try_acquire(group, participant_id, lease_duration, metadata)

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        if await self._gate("renew") is Fault.REFUSE:
            return False
        return await self.inner.renew(group, participant_id, token, lease_duration, metadata)

    async def release(self, group: str, participant_id: str, token: int) -> None:
        if await self._gate("release") is Fault.REFUSE:
            return
        await self.inner.release(group, participant_id, token)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        if await self._gate("get_leader") is Fault.REFUSE:
            return None
        return await self.inner.get_leader(group)

    async def contenders(self, group: str) -> Sequence[str]:
        if await self._gate("contenders") is Fault.REFUSE:
            return ()
        return await self.inner.contenders(group)

    @property
    def notify_delay(self) -> float:
        return self.inner.notify_delay

    @property
    def lease_bounds(self) -> LeaseBounds:
        return self.inner.lease_bounds

    @property
    def queues_candidates(self) -> bool:
        return self.inner.queues_candidates

    def watch(self, group: str) -> AsyncIterator[None] | None:
        inner = self.inner.watch(group)
        return None if inner is None else self._watch(inner)

    async def _watch(self, inner: AsyncIterator[None]) -> AsyncIterator[None]:
        try:
            async for _ in inner:
                while "watch" in self._faults:  # a cut-off participant hears nothing
                    fault = self._faults["watch"]
                    if fault is Fault.RAISE:
                        raise ProviderError("injected failure in watch")
                    await self._healed.wait()
                self.calls["watch"] += 1
                yield None
        finally:
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __repr__(self) -> str:
        return f"<FaultyProvider inner={self.inner!r} faults={self._faults}>"
