"""The kit's example provider in core's README runs, and passes the provider contract."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from multilock.core import ConfigurationError, LeaderElection
from multilock.core.testing import check_provider

README = Path(__file__).parent.parent / "packages" / "multilock-core" / "README.md"


def _example() -> dict[str, object]:
    text = README.read_text()
    section = text[text.index("## Writing a provider") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the kit section lost its example"
    namespace: dict[str, object] = {"__name__": "readme_kit"}
    exec(compile(code.group(1), str(README), "exec"), namespace)
    return namespace


def test_the_readme_provider_passes_the_contract() -> None:
    example = _example()
    store = example["ToyStore"]()  # type: ignore[operator]
    provider = example["ToyProvider"]

    async def main() -> None:
        await check_provider(lambda: provider(store), lease_duration=0.2)  # type: ignore[operator]

    asyncio.run(main())


def test_the_readme_provider_elects_and_declares_its_bounds() -> None:
    example = _example()
    store = example["ToyStore"]()  # type: ignore[operator]
    provider = example["ToyProvider"](store)  # type: ignore[operator]

    async def main() -> None:
        async with LeaderElection(provider, group="g", lease_duration=1) as election:
            held = await election.wait_until_leader(timeout=5)
            assert held.token == 1
        await provider.aclose()

    asyncio.run(main())
    with pytest.raises(ConfigurationError, match="the toy store's clock is coarse"):
        LeaderElection(provider, lease_duration=0.15)


def test_every_name_of_the_kit_is_documented_in_the_readme() -> None:
    import multilock.core.provider as kit

    text = README.read_text()
    section = text[text.index("## Writing a provider") :]
    # The name itself in code, not a longer name it begins (`Provider` in `ProviderError`).
    missing = [n for n in kit.__all__ if not re.search(rf"`{re.escape(n)}[`(.\[]", section)]
    assert missing == [], f"kit names the README's provider section never mentions: {missing}"
