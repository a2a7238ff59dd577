"""Election options as keywords are typed: mypy catches a misspelt name or a wrong type."""

from __future__ import annotations

import typing
from pathlib import Path

import attrs
import pytest

from multilock.core import ConfigurationError, ElectionFields, ElectionOptions, InMemoryProvider
from multilock.core import LeaderElection as AsyncLeaderElection

mypy_api = pytest.importorskip("mypy.api")

GOOD = """
from datetime import timedelta

from multilock.core import ElectionOptions, InMemoryProvider, LeaderElection
from multilock.core.sync import LeaderElection as SyncLeaderElection

provider = InMemoryProvider()
LeaderElection(
    provider,
    group="g",
    participant_id="p",
    lease_duration=timedelta(seconds=15),
    renew_interval=5,
    retry_interval=2.5,
    release_on_stop=False,
    metadata={"role": "cron"},
    max_clock_drift=0.02,
    probe_timeout=None,
)
LeaderElection(provider, ElectionOptions(lease_duration=15))
SyncLeaderElection("memory://", group="g", lease_duration=15, probe_timeout=5)
"""

MISSPELT = """
from multilock.core import InMemoryProvider, LeaderElection
from multilock.core.sync import LeaderElection as SyncLeaderElection

LeaderElection(InMemoryProvider(), lease_duraton=15)
SyncLeaderElection("memory://", retry_intreval=1)
"""

WRONG_TYPE = """
from multilock.core import InMemoryProvider, LeaderElection
from multilock.core.sync import LeaderElection as SyncLeaderElection

LeaderElection(InMemoryProvider(), lease_duration="15")
counts: dict[str, int] = {"k": 1}
SyncLeaderElection("memory://", metadata=counts)
"""


def test_the_typed_dict_lists_every_option_field() -> None:
    hints = typing.get_type_hints(ElectionFields)
    assert set(hints) == {field.name for field in attrs.fields(ElectionOptions)}
    assert ElectionFields.__total__ is False  # every keyword is optional


def test_unknown_names_are_still_refused_at_run_time() -> None:
    with pytest.raises(ConfigurationError, match="unknown election option") as info:
        AsyncLeaderElection(InMemoryProvider(), lease_duraton=15)  # type: ignore[call-arg]
    assert "lease_duration" in str(info.value)  # the known fields are listed


def test_mypy_catches_misspelt_names_and_wrong_types(tmp_path: Path) -> None:
    config = tmp_path / "mypy.ini"  # mypy's defaults, not the repository's settings
    config.write_text("[mypy]\n")
    files = {}
    for name, text in {"good": GOOD, "misspelt": MISSPELT, "wrong_type": WRONG_TYPE}.items():
        files[name] = tmp_path / f"{name}.py"
        files[name].write_text(text)
    stdout, stderr, status = mypy_api.run(
        [
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--config-file",
            str(config),
            *map(str, files.values()),
        ]
    )
    assert not stderr, stderr
    assert status == 1, stdout  # type errors found, and nothing else went wrong
    errors = [line for line in stdout.splitlines() if ": error:" in line]

    def of(name: str) -> list[str]:
        return [line for line in errors if line.startswith(str(files[name]))]

    assert of("good") == [], stdout + stderr
    misspelt = of("misspelt")
    assert len(misspelt) == 2, stdout
    assert 'Unexpected keyword argument "lease_duraton"' in misspelt[0]
    assert 'Unexpected keyword argument "retry_intreval"' in misspelt[1]
    wrong = of("wrong_type")
    assert len(wrong) == 2, stdout
    assert 'Argument "lease_duration"' in wrong[0]
    assert '"str"' in wrong[0]
    assert 'Argument "metadata"' in wrong[1]
    assert '"dict[str, int]"' in wrong[1]
