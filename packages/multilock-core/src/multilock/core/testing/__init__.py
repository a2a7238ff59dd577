"""Tools for testing code that uses multilock, and for testing providers.

- `check_provider`: the contract every provider must pass.
- `FakeClock`: virtual time for asyncio; nothing sleeps for real.
- `FaultyProvider` and `Fault`: make a provider hang, fail or refuse on demand.
- `Cluster`: participant processes on one backend, with real faults (SIGKILL, SIGSTOP).
- `check_timeline` and `read_event_logs`: prove that participants' logged leadership
  intervals never overlap and their tokens always rise.
- `simulate`: a deterministic simulation of several elections on a faulty store with a
  random user, in virtual time; one seed is one reproducible run, checked at every step.
- `simulate_holders`: the same for `Semaphore` and `Shards`, with their own invariants
  (at most *limit* holders, one owner per shard, balance after a quiet period).
"""

from ._clock import FakeClock
from ._cluster import Cluster, Member
from ._contract import PROVIDER_CHECKS, ProviderFactory, check_provider
from ._errors import error_texts
from ._faults import Fault, FaultyProvider
from ._simulate_holders import (
    HoldersConfig,
    HoldersReport,
    run_holder_simulations,
    simulate_holders,
)
from ._simulator import (
    SimulationConfig,
    SimulationFailure,
    SimulationReport,
    StoreFactory,
    run_simulations,
    simulate,
)
from ._timeline import Interval, TimelineReport, check_timeline, read_event_logs

__all__ = [
    "Cluster",
    "FakeClock",
    "Fault",
    "FaultyProvider",
    "HoldersConfig",
    "HoldersReport",
    "Interval",
    "Member",
    "PROVIDER_CHECKS",
    "ProviderFactory",
    "SimulationConfig",
    "SimulationFailure",
    "SimulationReport",
    "StoreFactory",
    "TimelineReport",
    "check_provider",
    "check_timeline",
    "error_texts",
    "read_event_logs",
    "run_holder_simulations",
    "run_simulations",
    "simulate",
    "simulate_holders",
]
