"""`ElectionOptions`: every knob of an election, validated once, at construction.

`ElectionFields` types the same knobs as keywords (``LeaderElection(provider,
lease_duration=15)``), so that mypy and IDEs catch a misspelt name or a wrong type.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, TypedDict

import attrs

from ._errors import ConfigurationError
from ._names import (
    MAX_METADATA_ENTRIES,
    default_participant_id,
    to_seconds,
    validate_metadata,
    validate_name,
)
from ._types import LeaderInfo

__all__ = ["INSTANCE_KEY", "MIN_LEASE_DURATION", "ElectionFields", "ElectionOptions", "public_info"]

#: The metadata key under which an election stores its run's nonce with every term, so it
#: recognises its own terms (a lost acquire reply) and never another process's with the
#: same participant id. Every key under ``multilock.`` is reserved: user metadata cannot
#: use one, and the election removes this one from the `LeaderInfo` it reports.
INSTANCE_KEY = "multilock.instance"

#: The shortest lease an election accepts, in seconds. A term is renewed every third of
#: its lease, and each renew is a store round trip plus the event loop's scheduling delay
#: (milliseconds each); below this the renewals cannot keep up and the leader flaps. The
#: bound is far below any sensible lease (the default is 15 s) and at or below the
#: shortest the tests and benchmarks use (0.1 s).
MIN_LEASE_DURATION = 0.1

Duration = float | timedelta


def public_info(info: LeaderInfo | None) -> LeaderInfo | None:
    """*info* without the election's private instance nonce, as users are shown it."""
    if info is None or INSTANCE_KEY not in info.metadata:
        return info
    metadata = {k: v for k, v in info.metadata.items() if k != INSTANCE_KEY}
    return attrs.evolve(info, metadata=metadata)


class ElectionFields(TypedDict, total=False):
    """The fields of `ElectionOptions` as keywords, with the types each accepts.

    ``LeaderElection(provider, **fields: Unpack[ElectionFields])``: a misspelt name or a
    wrong type is a type-checker error, and IDEs complete the names. At run time the same
    values are validated by `ElectionOptions`.
    """

    group: str
    participant_id: str
    lease_duration: Duration
    renew_interval: Duration
    retry_interval: Duration
    release_on_stop: bool
    metadata: Mapping[str, str]
    max_clock_drift: float
    probe_timeout: Duration | None


def _lease(value: Any) -> float:
    seconds = to_seconds(value, "lease_duration")
    if seconds < MIN_LEASE_DURATION:
        raise ConfigurationError(
            f"lease_duration={seconds:g} s is too short: the minimum is "
            f"{MIN_LEASE_DURATION:g} s, because the leader renews every third of the lease "
            "and each renew costs a store round trip plus event-loop delay, so a shorter "
            "lease makes leadership flap (the default is 15 s; use seconds, not milliseconds)"
        )
    return seconds


def _renew(value: Any) -> float:
    return to_seconds(value, "renew_interval")


def _retry(value: Any) -> float:
    return to_seconds(value, "retry_interval")


def _group(value: Any) -> str:
    return validate_name(value, "group")


def _participant(value: Any) -> str:
    return validate_name(value, "participant_id")


def _drift(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"max_clock_drift must be a number, not {type(value).__name__}")
    if not (math.isfinite(value) and 0 <= value < 0.5):
        raise ConfigurationError(f"max_clock_drift must be in [0, 0.5), got {value!r}")
    return float(value)


def _metadata(value: Any) -> dict[str, str]:
    metadata = validate_metadata(value)
    reserved = sorted(key for key in metadata if key.startswith("multilock."))
    if reserved:
        raise ConfigurationError(
            f"metadata key(s) {', '.join(map(repr, reserved))} are reserved: keys starting "
            "with 'multilock.' belong to the library"
        )
    if len(metadata) >= MAX_METADATA_ENTRIES:
        raise ConfigurationError(
            f"metadata has {len(metadata)} entries; an election allows at most "
            f"{MAX_METADATA_ENTRIES - 1} (it adds one of its own)"
        )
    return metadata


def _probe_timeout(value: Any) -> float | None:
    return None if value is None else to_seconds(value, "probe_timeout")


def _release_on_stop(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"release_on_stop must be True or False, not {value!r}")
    return value


@attrs.frozen(kw_only=True)
class ElectionOptions:
    """How one participant campaigns for one group.

    Durations are float seconds or `timedelta`; they are stored as float seconds. The
    timings must satisfy ``2 * renew_interval < lease_duration * (1 - max_clock_drift)``
    (the leader can miss one renew and still renew before its deadline) and
    ``retry_interval <= lease_duration``; otherwise `ConfigurationError` names the rule
    and the values. ``lease_duration`` must be at least `MIN_LEASE_DURATION` (0.1 s):
    renewing a shorter lease every third of it cannot keep up with a store round trip and
    the event loop's delays. A provider may narrow the range further
    (``provider.lease_bounds``).

    ``probe_timeout`` (default None): when set, ``start()`` first asks the store for the
    leader once, within that many seconds, and raises `ProviderError` (with a
    `FailureReason`) if it cannot, instead of campaigning on and logging a warning every
    few seconds: a wrong host, port or password fails at start.
    """

    group: str = attrs.field(default="default", converter=_group)
    participant_id: str = attrs.field(factory=default_participant_id, converter=_participant)
    lease_duration: float = attrs.field(default=15.0, converter=_lease)
    #: Default: a third of the lease.
    renew_interval: float = attrs.field(
        default=attrs.Factory(lambda self: self.lease_duration / 3, takes_self=True),
        converter=_renew,
    )
    #: Default: 2 s, or the lease if that is shorter. Jittered down by up to a quarter.
    retry_interval: float = attrs.field(
        default=attrs.Factory(lambda self: min(2.0, self.lease_duration), takes_self=True),
        converter=_retry,
    )
    release_on_stop: bool = attrs.field(default=True, converter=_release_on_stop)
    #: At most ``MAX_METADATA_ENTRIES - 1`` entries: the election adds `INSTANCE_KEY`.
    metadata: Mapping[str, str] = attrs.field(factory=dict, converter=_metadata, hash=False)
    max_clock_drift: float = attrs.field(default=0.01, converter=_drift)
    #: Seconds ``start()`` gives one probe of the store (None: no probe).
    probe_timeout: float | None = attrs.field(default=None, converter=_probe_timeout)

    def __attrs_post_init__(self) -> None:
        usable = self.lease_duration * (1 - self.max_clock_drift)
        if not 2 * self.renew_interval < usable:
            raise ConfigurationError(
                "renew_interval is too long for lease_duration: the rule "
                "2 * renew_interval < lease_duration * (1 - max_clock_drift) gives "
                f"2 * {self.renew_interval:g} = {2 * self.renew_interval:g} which is not less "
                f"than {self.lease_duration:g} * (1 - {self.max_clock_drift:g}) = {usable:g}"
            )
        if not self.retry_interval <= self.lease_duration:
            raise ConfigurationError(
                "retry_interval must not exceed lease_duration: "
                f"{self.retry_interval:g} > {self.lease_duration:g}"
            )

    @property
    def step_down_margin(self) -> float:
        """Seconds a leader keeps in hand to stop its work before the store can expire it."""
        return min(0.25, 0.02 * self.lease_duration)

    @property
    def worst_case_failover(self) -> float:
        """Seconds from a leader's crash until a live candidate can lead (store delay aside)."""
        return self.lease_duration + self.retry_interval

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> ElectionOptions:
        """Build from keywords, turning an unknown name into a `ConfigurationError`."""
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigurationError(
                f"unknown election option(s) {', '.join(unknown)}; "
                f"valid options are {', '.join(sorted(known))}"
            )
        return cls(**fields)
