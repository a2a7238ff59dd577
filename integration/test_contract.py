"""The provider contract (`multilock.core.testing.check_provider`) on every backend."""

from __future__ import annotations

import pytest

from harness import Backend
from multilock.core.testing import PROVIDER_CHECKS, check_provider


@pytest.mark.parametrize("check", list(PROVIDER_CHECKS))
async def test_provider_contract(backend: Backend, check: str) -> None:
    await check_provider(backend.make_provider, lease_duration=backend.lease, only=check)
