"""The kit for backend authors: everything a provider needs from core, in one public module.

A backend imports only from here (and `multilock.core`'s public names), never from a
``multilock.core._*`` module::

    from multilock.core.provider import (
        DriverCalls, LeaderInfo, LeaseBounds, Notifications, Provider, ProviderError,
    )

- `Provider`: the interface. Its subclasses' methods receive checked arguments (valid
  names, float seconds, a plain metadata dict, a positive token): never check them again.
- `LeaseBounds`: declare the lease durations the store can hold (``lease_bounds``).
- `DriverCalls`: call the driver bounded in time, in a worker thread if it blocks, with
  its failures turned into secret-free `ProviderError` messages.
- `Notifications`: one listener (one connection) per provider, fanned out to the watches
  of every group, waking each also when the lease it saw is due to end.
- `poll_watch` and `Observed`: the watch of a store that cannot notify.
- `Batches`: send the calls of one kind asked for in one loop turn together (the
  renewals of a process leading many groups: one pipeline, one statement).
- `to_seconds`, `validate_name`, `validate_metadata`: for a provider's own settings
  (URL options, constructor arguments); `validate_identifier` for SQL schema and table
  names.
- `check_url_options`, `url_seconds`, `url_flag`: a URL's query options, read alike by
  every provider (unknown names refused with the closest known one; seconds and flags
  read from text with one message each).
- `split_url`: split a provider's URL, refusing (without quoting it) one that holds a
  secret cut short: a host or port that does not parse (a password with an unencoded
  ``/``, ``?`` or ``#``), a ``#`` part, a query secret cut by an ``&``; or a port 0.
- `redact_url` and `scrub`: a URL fit for messages, and a message without the URL's
  secrets.
- `raise_if_cancelled`: honour a cancellation that a driver call swallowed (Python
  3.11's ``wait_for`` can return a result with the cancellation still requested).
- `call_until`: await a coroutine until a deadline on the loop's clock, without waiting
  for a slow cancellation.
"""

from ._batches import Batches
from ._calls import call_until, raise_if_cancelled
from ._driver import DriverCalls
from ._errors import ConfigurationError, ProviderError
from ._names import to_seconds, validate_identifier, validate_metadata, validate_name
from ._provider import LeaseBounds, Provider
from ._types import LeaderInfo
from ._url import redact_url, scrub, split_url
from ._url_options import check_url_options, url_flag, url_seconds
from ._watching import EXPIRY_SLACK, Notifications, Observed, poll_watch

__all__ = [
    "EXPIRY_SLACK",
    "Batches",
    "ConfigurationError",
    "DriverCalls",
    "LeaderInfo",
    "LeaseBounds",
    "Notifications",
    "Observed",
    "Provider",
    "ProviderError",
    "call_until",
    "check_url_options",
    "poll_watch",
    "raise_if_cancelled",
    "redact_url",
    "scrub",
    "split_url",
    "to_seconds",
    "url_flag",
    "url_seconds",
    "validate_identifier",
    "validate_metadata",
    "validate_name",
]
