"""multilock.core: leader election for asyncio services.

Many copies of a service run at once; for each named group, exactly one leads. See
`LeaderElection` to campaign, `Lock`, `Semaphore` and `Shards` to hold names across
processes, `watch_leader` to observe, `contenders` to list who campaigns, `from_url` to
build a provider, `probe` to check a store before relying on it, and `multilock.core.sync`
for threaded programs.
"""

from ._contenders import contenders
from ._election import LeaderElection
from ._errors import (
    ConfigurationError,
    LeadershipLost,
    MultilockError,
    ProviderError,
    UnsupportedOperation,
)
from ._events import EventStream, on_transition, until_leader, while_leader
from ._failures import FailureReason
from ._lock import AcquireTimeout, HolderFields, Lock, Semaphore, SemaphoreSlot
from ._memory import InMemoryProvider
from ._names import validate_metadata, validate_name
from ._observe import ElectionObserver, Health, add_observer, remove_observer
from ._options import MIN_LEASE_DURATION, ElectionFields, ElectionOptions
from ._probe import probe
from ._provider import Provider
from ._shards import ShardLeadership, Shards
from ._signals import stop_on_signals
from ._types import (
    ElectionState,
    ElectionStatistics,
    EventKind,
    LeaderInfo,
    Leadership,
    LeadershipEvent,
    RunResult,
    RunStatus,
)
from ._url import available_schemes, from_url, redact_url
from ._watch import watch_leader

__all__ = [
    "MIN_LEASE_DURATION",
    "AcquireTimeout",
    "ConfigurationError",
    "ElectionFields",
    "ElectionObserver",
    "ElectionOptions",
    "ElectionState",
    "ElectionStatistics",
    "EventKind",
    "EventStream",
    "FailureReason",
    "Health",
    "HolderFields",
    "InMemoryProvider",
    "LeaderElection",
    "LeaderInfo",
    "Leadership",
    "LeadershipEvent",
    "LeadershipLost",
    "Lock",
    "MultilockError",
    "Provider",
    "ProviderError",
    "RunResult",
    "RunStatus",
    "Semaphore",
    "SemaphoreSlot",
    "ShardLeadership",
    "Shards",
    "UnsupportedOperation",
    "add_observer",
    "available_schemes",
    "contenders",
    "from_url",
    "on_transition",
    "probe",
    "redact_url",
    "remove_observer",
    "stop_on_signals",
    "until_leader",
    "validate_metadata",
    "validate_name",
    "watch_leader",
    "while_leader",
]

__version__ = "0.1.0"
