-- Slots of concurrent limits (issue 23), renewed or released by the
-- request that holds them. A slot is a member of its limit's sorted set
-- (script.lua takes it), scored with its expiry in Redis time.
--
-- KEYS[i]      the sorted set of concurrent limit i
-- ARGV[1]      "renew" or "release"
-- a renewal:
--   ARGV[3i-1]   the request's slot id in KEYS[i]
--   ARGV[3i]     its limit's hold, in microseconds: a renewed slot
--                expires then
--   ARGV[3i+1]   the slots n into which a gone slot may come back: its
--                limit's n when the last renewal found it gone, else 0
--                (a renewal only extends a live slot)
-- a release:
--   ARGV[i+1]    the request's slot id in KEYS[i]
--
-- A renewal extends the slot while it is live, and never brings back one
-- that is gone: a renewal that reaches Redis after the slot's release
-- (its answer lost, its release sent meanwhile) must not take the slot
-- again for a request that has ended. A slot gone for another reason
-- (expired, freed by the admin API, or lost with Redis's data: FLUSHALL,
-- a restart without persistence, a failover to a replica that had not
-- seen it) comes back at the request's next renewal, which asks for it
-- with its n: while fewer than n slots are live, so the request counts
-- again and never more than n are held; otherwise the slot stays gone,
-- and a later renewal asks again. Such a renewal is a take of the slot,
-- and one that lands after the release is undone as a late take is (the
-- release is sent again until it frees the slot, or the slot would have
-- expired). A release removes the slot; one released twice, or expired,
-- is gone already.
--
-- Returns, for each key: 1 when the slot was renewed or released, 2 when
-- a renewal brought it back, 3 when a renewal found it gone and was not
-- asked to bring it back, 0 when it was gone (and, for a renewal asked
-- to bring it back, every slot taken).

local reply = {}
if ARGV[1] == 'release' then
  for i = 1, #KEYS do
    reply[i] = redis.call('ZREM', KEYS[i], ARGV[i + 1])
  end
  return reply
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
for i = 1, #KEYS do
  local id, hold, n = ARGV[3 * i - 1], tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  local expires = tonumber(redis.call('ZSCORE', KEYS[i], id))
  if expires and expires > now then
    reply[i] = 1
  elseif n == 0 then
    reply[i] = 3
  else
    -- Gone, or expired (free, and maybe taken by another request since):
    -- back only into a free slot.
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    if redis.call('ZCARD', KEYS[i]) < n then
      reply[i] = 2
    else
      reply[i] = 0
    end
  end
  if reply[i] == 1 or reply[i] == 2 then
    redis.call('ZADD', KEYS[i], now + hold, id)
    local ms = math.ceil(hold / 1000)
    if redis.call('PTTL', KEYS[i]) < ms then
      redis.call('PEXPIRE', KEYS[i], ms)
    end
  end
end
return reply
