"""`LeaderScheduler`: run ``celery beat`` on every replica; only the leader sends tasks.

Guarantees:

- Sending is gated per entry: every `LeaderScheduler.tick` reads the election's local
  ``leadership`` (no I/O) and hands over to celery's own tick, which sends at most one due
  entry, only while this replica holds a valid term. A term ends on this replica's own
  clock before the store can give the lease to anyone else (multilock's safety rule), so
  two replicas never send in the same instant; the window left is one publish that began
  just before the deadline.
- A graceful stop (``SIGTERM``, ``SIGINT``, embedded beat stopping) releases the lease in
  `LeaderScheduler.close`, and a follower blocked in its tick wakes at once: the handoff
  takes milliseconds. After a crash (``SIGKILL``, power loss) a follower leads at most
  ``lease_duration + retry_interval`` later.

Not guaranteed: each replica keeps its own schedule file, so ``last_run_at`` is not
shared. What that means at a handoff, with and without ``multilock_reset_on_acquire``, is
spelled out in the package README; in short, the default (reset) never re-sends what the
previous leader sent but skips an occurrence that fell due while nobody led.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery.beat import PersistentScheduler  # type: ignore[import-untyped]

from multilock.core import (
    ConfigurationError,
    ElectionOptions,
    Leadership,
    MultilockError,
    Provider,
    redact_url,
)
from multilock.core.sync import LeaderElection

__all__ = ["DEFAULT_GROUP", "LeaderScheduler"]

log = logging.getLogger(__name__)

#: The group replicas campaign for when ``multilock_group`` is not set.
DEFAULT_GROUP = "celery-beat"


@dataclass(frozen=True)
class _Config:
    """The scheduler's settings, read and checked once from the Celery app's config."""

    target: str | Provider
    options: ElectionOptions
    reset_on_acquire: bool

    @property
    def where(self) -> str:
        """The store, fit for logs: a URL without its secrets, or the provider's repr."""
        return redact_url(self.target) if isinstance(self.target, str) else repr(self.target)


def _read_config(conf: Mapping[str, Any]) -> _Config:
    """Check the ``multilock_*`` settings; raise `ConfigurationError` naming the bad one."""
    target = conf.get("multilock_url")
    if target is None or target == "":
        raise ConfigurationError(
            "multilock.celery.LeaderScheduler needs the Celery setting multilock_url: the "
            "URL of the store that elects the beat leader, e.g. "
            "app.conf.multilock_url = 'redis://localhost:6379/0'"
        )
    if not isinstance(target, str | Provider):
        raise ConfigurationError(
            "the Celery setting multilock_url must be a URL (str) or a multilock Provider, "
            f"not {type(target).__name__}"
        )
    group = conf.get("multilock_group")
    group = DEFAULT_GROUP if group is None else group
    fields = conf.get("multilock_options")
    fields = {} if fields is None else fields
    if not isinstance(fields, Mapping):
        raise ConfigurationError(
            "the Celery setting multilock_options must be a dict of election options "
            f"(lease_duration, retry_interval, ...), not {type(fields).__name__}"
        )
    if "group" in fields:
        raise ConfigurationError(
            "set the group with the Celery setting multilock_group, not in multilock_options"
        )
    try:
        options = ElectionOptions.from_fields({**fields, "group": group})
    except ConfigurationError as exc:
        raise ConfigurationError(f"multilock_group/multilock_options: {exc}") from exc
    reset = conf.get("multilock_reset_on_acquire")
    reset = True if reset is None else reset
    if not isinstance(reset, bool):
        raise ConfigurationError(
            "the Celery setting multilock_reset_on_acquire must be True or False, "
            f"not {type(reset).__name__}"
        )
    return _Config(target, options, reset)


class LeaderScheduler(PersistentScheduler):  # type: ignore[misc]  # celery is untyped
    """celery beat's `PersistentScheduler`, sending due tasks only while it leads.

    Use it on every replica: ``celery -A proj beat -S multilock.celery:LeaderScheduler``
    (or ``app.conf.beat_scheduler``). Settings, in the Celery app's config:

    - ``multilock_url`` (required): the store's URL, or a multilock `Provider` (which the
      scheduler never closes).
    - ``multilock_group`` (default ``"celery-beat"``): one group per set of replicas
      sharing one schedule.
    - ``multilock_options``: `ElectionOptions` fields as a dict (``lease_duration``,
      ``retry_interval``, ``participant_id``, ...), without ``group``.
    - ``multilock_reset_on_acquire`` (default True): at the start of each term, restart
      every entry's schedule from now, so the new leader does not re-send what the
      previous leader already sent (see the README for both choices).

    The election starts in `setup_schedule` (never for the ``lazy`` instances beat builds
    for its banner) and is stopped, releasing the lease, in `close`.
    """

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        # Read before celery's __init__, which calls setup_schedule unless lazy.
        self._config = _read_config(app.conf)
        self._election: LeaderElection | None = None
        self._token: int | None = None  # the term this replica is sending in
        super().__init__(app, *args, **kwargs)

    @property
    def election(self) -> LeaderElection | None:
        """The running election (None before `setup_schedule` and after `close`)."""
        return self._election

    def create_election(self, target: str | Provider, options: ElectionOptions) -> LeaderElection:
        """Build the (not yet started) election; override to build it another way."""
        return LeaderElection(target, options)

    def setup_schedule(self) -> None:
        """Open the schedule as celery does, then start campaigning."""
        super().setup_schedule()
        if self._election is not None:
            return
        config = self._config
        election = self.create_election(config.target, config.options)
        try:
            election.start()
        except BaseException:
            election.close()
            raise
        self._election = election
        log.info(
            "beat campaigns for group %s as %s on %s",
            election.group,
            election.participant_id,
            config.where,
        )

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Send the next due entry if this replica leads; else wait a little for a term.

        A follower blocks here at most ``min(retry_interval, max_interval)`` seconds,
        waking the moment it wins a term (so a graceful handoff takes milliseconds, not a
        polling period), and returns 0 if it did not: beat calls tick again at once.
        """
        election = self._election
        if election is None or election.closed:
            return float(self.max_interval)
        leadership = election.leadership
        if leadership is None:
            self._end_term("the term ended")
            leadership = self._wait_for_term(election)
            if leadership is None:
                return 0.0
        if leadership.token != self._token:
            self._begin_term(leadership)
        return float(super().tick(*args, **kwargs))

    def _wait_for_term(self, election: LeaderElection) -> Leadership | None:
        timeout = min(election.options.retry_interval, float(self.max_interval))
        try:
            return election.wait_until_leader(timeout=timeout)
        except TimeoutError:
            return None

    def _begin_term(self, leadership: Leadership) -> None:
        self._end_term("a new term began")
        self._token = leadership.token
        log.info(
            "ACQUIRED: beat leads group %s (token %d): this replica sends the schedule",
            leadership.group,
            leadership.token,
        )
        if self._config.reset_on_acquire:
            self._restart_schedule()

    def _end_term(self, why: str) -> None:
        if self._token is None:
            return
        log.info(
            "LOST: beat no longer leads group %s (token %d, %s): this replica stopped sending",
            self._config.options.group,
            self._token,
            why,
        )
        self._token = None

    def _restart_schedule(self) -> None:
        """Count every entry's next run from now, as if each had just been sent.

        ``last_run_at`` lives in this replica's own schedule file: it tells nothing of
        what the previous leader sent, so without this an entry looks due at once if this
        replica has not sent it lately (for a crontab: since its last occurrence).
        """
        for entry in self.schedule.values():
            entry.last_run_at = entry.default_now()
        self.populate_heap()
        log.debug("beat: every entry's schedule restarts from now")

    def close(self) -> None:
        """Stop the election (ending the term, releasing the lease), then close as celery does.

        Idempotent: beat calls it twice on ``SIGTERM``.
        """
        election, self._election = self._election, None
        try:
            if election is not None:
                try:
                    election.close()
                except MultilockError:  # the store is away: the lease expires by itself
                    log.warning("beat: could not release the lease", exc_info=True)
                self._end_term("beat is stopping")
        finally:
            super().close()

    @property
    def info(self) -> str:
        """The banner lines of ``celery beat``: the schedule file, then the election."""
        group, where = self._config.options.group, self._config.where
        return f"{super().info}\n    . leader election -> group {group} on {where}"
