"""The exceptions of multilock, one tree for every backend::

    MultilockError
     +-- ConfigurationError (also a ValueError): bad options, names, metadata or URLs
     +-- ProviderError: a call to the store failed; the driver's error is ``__cause__``
                        (unless it held a secret); ``.reason`` says why, as a `FailureReason`
     +-- LeadershipLost: the term this code relied on has ended
     +-- UnsupportedOperation (also a NotImplementedError): this store cannot do that

A lost lease is never reported as a silent ``False`` to user code: ``Leadership.check()``
raises `LeadershipLost`.
"""

from __future__ import annotations

from ._failures import FailureReason, classify

__all__ = [
    "ConfigurationError",
    "LeadershipLost",
    "MultilockError",
    "ProviderError",
    "UnsupportedOperation",
]


class MultilockError(Exception):
    """Base class of every exception raised by multilock."""


class ConfigurationError(MultilockError, ValueError):
    """Reject invalid options, names, metadata or URLs, at the boundary."""


class ProviderError(MultilockError):
    """A backend call failed (network, server, driver); the term may or may not be intact.

    `reason` says why (the host does not resolve, the connection was refused, the
    credentials were refused, TLS failed, no answer in time, or other), so code can
    branch on it: given by whoever raised the error, or else read from its chain.
    """

    def __init__(self, *args: object, reason: FailureReason | None = None) -> None:
        super().__init__(*args)
        self._reason = reason

    @property
    def reason(self) -> FailureReason:
        """Why the call failed; classified from the exception chain unless given."""
        return self._reason if self._reason is not None else classify(self)


class LeadershipLost(MultilockError):
    """The leadership term has ended: stop touching what it protected."""

    def __init__(self, group: str, token: int, reason: str = "leadership lost") -> None:
        super().__init__(f"{reason} (group={group!r}, token={token})")
        self.group = group
        self.token = token


class UnsupportedOperation(MultilockError, NotImplementedError):
    """This store cannot do that: the message names the provider and why.

    Raised by optional provider operations (`Provider.contenders`) on a store that keeps no
    record they could be answered from; retrying never helps.
    """
