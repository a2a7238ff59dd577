"""The Lua scripts and key names both providers run on every Redis server.

Keys of a group (``{group}`` is a Redis Cluster hash tag, so all of them share one slot):

- ``<prefix>{<group>}:lease``: a hash (participant, token, metadata, acquired_at, and for
  Redlock the attempt id) with a PX expiry. It exists exactly while a lease is live: Redis
  judges expiry on its own clock. Only the script that creates it writes the metadata it
  starts with, so a term reads back as it was made until its holder renews it.
- ``<prefix>{<group>}:token``: the last token handed out. Never deleted, no TTL.
- channel ``<prefix>{<group>}:changed``: a message on every new term (``acquired <lease
  ms>``, so a watch knows when it ends without asking) and every release (``released``).
  A Redlock lease adds its attempt id to both (``acquired <lease ms> <attempt>``,
  ``released <attempt>``), so that the copies of one event from the servers are known
  as one. A watch subscribes to the pattern `channel_pattern` once for all groups.

Tokens are decimal strings in Redis and never pass through Lua's ``tostring`` (which
prints large numbers in exponent form); Lua numbers are doubles, exact below 2**53, and
a token that counts microseconds since 1970 stays below that until the year 2255.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE",
    "CHANGED",
    "COMMIT",
    "RELEASE",
    "RENEW",
    "channel_name",
    "channel_pattern",
    "lease_key",
    "token_key",
]

CHANGED = "}:changed"

# KEYS: lease, token counter. ARGV: participant, lease ms, metadata JSON, candidate token,
# clock floor ("1"/"0"), channel, attempt id ("" for none).
# Returns false while any lease is live, the caller's own participant id included: a live
# term is never joined, and a refused call writes nothing. Else {token, acquired_at_us}.
#
# The new token is max(counter + 1, candidate). A missing counter (a Redis that restarted
# without its data) counts as the server's TIME in microseconds; with the clock floor
# on, so does a counter that is behind TIME (a restore from an old snapshot, a failover to
# a lagging replica). Both assume that the server clock does not go back by more than the
# time between the last token and the restart, and that no counter ever outruns the
# clock, which holds because a script takes far longer than one microsecond to run.
ACQUIRE = """
if redis.call('HMGET', KEYS[1], 'participant')[1] then
  return false
end
local now = redis.call('TIME')
local clock = tonumber(now[1]) * 1000000 + tonumber(now[2])
local last = tonumber(redis.call('GET', KEYS[2]) or '')
if last == nil or (ARGV[5] == '1' and last < clock) then
  last = clock
end
local token = string.format('%.0f', math.max(last + 1, tonumber(ARGV[4])))
local at = string.format('%.0f', clock)
redis.call('SET', KEYS[2], token)
redis.call('HSET', KEYS[1], 'participant', ARGV[1], 'token', token,
           'metadata', ARGV[3], 'acquired_at', at)
local message = 'acquired ' .. ARGV[2]
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[1], 'attempt', ARGV[7])
  message = message .. ' ' .. ARGV[7]
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[6], message)
return {token, at}
"""

# KEYS: lease. ARGV: participant, token, lease ms, metadata JSON. Returns 1 if renewed.
RENEW = """
local held = redis.call('HMGET', KEYS[1], 'participant', 'token')
if held[1] == ARGV[1] and held[2] == ARGV[2] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  redis.call('HSET', KEYS[1], 'metadata', ARGV[4])
  return 1
end
return 0
"""

# KEYS: lease. ARGV: participant, token, channel, attempt id. Returns 1 if released.
# With no attempt id ("") it releases only that participant's lease with that token. With
# one, it releases the participant's lease that this attempt created, whatever its token
# (Redlock's undo of an attempt whose replies did not all come, or whose commit may have
# moved the token): never another attempt's lease, even one with the same participant id.
RELEASE = """
local held = redis.call('HMGET', KEYS[1], 'participant', 'token', 'attempt')
if held[1] ~= ARGV[1] then
  return 0
end
if ARGV[4] ~= '' then
  if held[3] ~= ARGV[4] then
    return 0
  end
elseif held[2] ~= ARGV[2] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[3], held[3] and 'released ' .. held[3] or 'released')
return 1
"""

# Redlock only. KEYS: lease, token counter. ARGV: participant, token this node gave, the
# term's token (the largest any node gave). Moves this node's lease and counter up to the
# term's token, so that a majority of counters is at least the token of every term.
COMMIT = """
local held = redis.call('HMGET', KEYS[1], 'participant', 'token')
if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], 'token', ARGV[3])
local last = tonumber(redis.call('GET', KEYS[2]) or '')
if last == nil or last < tonumber(ARGV[3]) then
  redis.call('SET', KEYS[2], ARGV[3])
end
return 1
"""


def lease_key(prefix: str, group: str) -> str:
    return f"{prefix}{{{group}}}:lease"


def token_key(prefix: str, group: str) -> str:
    return f"{prefix}{{{group}}}:token"


def channel_name(prefix: str, group: str) -> str:
    return f"{prefix}{{{group}{CHANGED}"


def channel_pattern(prefix: str) -> str:
    """The PSUBSCRIBE pattern of every group's channel (the prefix's glob characters escaped)."""
    escaped = "".join(f"\\{c}" if c in "*?[]\\^" else c for c in prefix)
    return f"{escaped}{{*{CHANGED}"
