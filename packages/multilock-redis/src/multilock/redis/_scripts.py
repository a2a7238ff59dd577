"""The Lua scripts and key names both providers run on every Redis server.

Keys of a group (``{group}`` is a Redis Cluster hash tag, so all of them share one slot):

- ``<prefix>{<group>}:lease``: a hash (participant, token, metadata, acquired_at) with a
  PX expiry. It exists exactly while a lease is live: Redis judges expiry on its own clock.
- ``<prefix>{<group>}:token``: the last token handed out. Never deleted, no TTL.
- channel ``<prefix>{<group>}:changed``: a message on every new term and every release.

Tokens are decimal strings in Redis and never pass through Lua's ``tostring`` (which
prints large numbers in exponent form); Lua numbers are doubles, exact below 2**53, and
a token that counts microseconds since 1970 stays below that until the year 2255.
"""

from __future__ import annotations

__all__ = ["ACQUIRE", "COMMIT", "RELEASE", "RENEW", "channel_name", "lease_key", "token_key"]

# KEYS: lease, token counter.
# ARGV: participant, lease ms, metadata JSON, candidate token, clock floor ("1"/"0"), channel.
# Returns false when another participant holds the lease, else {token, acquired_at_us, new}.
#
# The new token is max(counter + 1, candidate). A missing counter (a Redis that restarted
# without its data) counts as the server's TIME in microseconds; with the clock floor
# on, so does a counter that is behind TIME (a restore from an old snapshot, a failover to
# a lagging replica). Both assume that the server clock does not go back by more than the
# time between the last token and the restart, and that no counter ever outruns the
# clock, which holds because a script takes far longer than one microsecond to run.
ACQUIRE = """
local held = redis.call('HMGET', KEYS[1], 'participant', 'token', 'acquired_at')
if held[1] then
  if held[1] ~= ARGV[1] then
    return false
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('HSET', KEYS[1], 'metadata', ARGV[3])
  return {held[2], held[3], '0'}
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
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[6], 'acquired')
return {token, at, '1'}
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

# KEYS: lease. ARGV: participant, token, channel, mode. Returns 1 if released.
# Mode "=" releases only that token; ">=" releases any of the participant's leases with a
# token at least that large (Redlock's undo of an attempt whose reply never came).
RELEASE = """
local held = redis.call('HMGET', KEYS[1], 'participant', 'token')
if held[1] ~= ARGV[1] or not held[2] then
  return 0
end
if ARGV[4] == '>=' then
  if tonumber(held[2]) < tonumber(ARGV[2]) then
    return 0
  end
elseif held[2] ~= ARGV[2] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[3], 'released')
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
    return f"{prefix}{{{group}}}:changed"
