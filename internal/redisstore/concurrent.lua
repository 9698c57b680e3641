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
--
-- Queues (issue 40; script.lua has them, and pump as here): ARGV[1] is
--   "releaseq": a release, as above, of slots of limits that queue: each
--     slot freed goes to the head of its key's queue at once (pump);
--   "wait": a waiter's renewal of its queue entry, KEYS[1] the slot key,
--     ARGV[2] its member, ARGV[3] its slot id, ARGV[4] the hold
--     (microseconds): the member expires a hold from now. The queue
--     grants what is free first. Returns {1} while it waits, {2} when it
--     holds its slot (granted: its grant's message may have been lost),
--     {0} when it is gone (expired);
--   "leave": a waiter leaves, KEYS[1] and ARGV[2], ARGV[3] as for
--     "wait": out of the queue, or, when it was granted its slot
--     meanwhile, the slot given back (to the next head). Returns {1} when
--     it left the queue, {2} when it gave back a slot granted, {0} when
--     it was gone.

local reply = {}
if ARGV[1] == 'release' then
  for i = 1, #KEYS do
    reply[i] = redis.call('ZREM', KEYS[i], ARGV[i + 1])
  end
  return reply
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

-- expireAtLeast makes key live at least ms milliseconds.
local function expireAtLeast(key, ms)
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end
-- pump grants the free slots of the set at key to the heads of its queue,
-- after dropping expired slots and members (script.lua's, but for the
-- purge of slots).
local function pump(key)
  local q, t = key .. '|q', key .. '|t'
  if redis.call('ZCARD', t) == 0 then
    return
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local used = redis.call('ZCARD', key)
  local gone = redis.call('ZRANGEBYSCORE', t, '-inf', now, 'LIMIT', 0, 1000)
  for j = 1, #gone do
    redis.call('ZREM', q, gone[j])
    redis.call('ZREM', t, gone[j])
  end
  while true do
    local head = redis.call('ZRANGE', q, 0, 0)
    if #head == 0 then
      break
    end
    local n, h, id, channel = string.match(head[1], '^%d+ (%d+) (%d+) (%S+) (.+)$')
    n, h = tonumber(n), tonumber(h)
    if not n or used >= n then
      break
    end
    redis.call('ZREM', q, head[1])
    redis.call('ZREM', t, head[1])
    redis.call('ZADD', key, now + h, id)
    expireAtLeast(key, math.ceil(h / 1000))
    redis.call('PUBLISH', channel, id .. ' ' .. key)
    used = used + 1
  end
end

if ARGV[1] == 'releaseq' then
  for i = 1, #KEYS do
    reply[i] = redis.call('ZREM', KEYS[i], ARGV[i + 1])
    pump(KEYS[i])
  end
  return reply
end
if ARGV[1] == 'wait' or ARGV[1] == 'leave' then
  local key, member, id = KEYS[1], ARGV[2], ARGV[3]
  local q, t = key .. '|q', key .. '|t'
  if ARGV[1] == 'leave' then
    if redis.call('ZREM', q, member) == 1 then
      redis.call('ZREM', t, member)
      return {1}
    end
    if redis.call('ZREM', key, id) == 1 then
      pump(key)
      return {2}
    end
    return {0}
  end
  pump(key)
  if redis.call('ZSCORE', t, member) then
    local hold = tonumber(ARGV[4])
    redis.call('ZADD', t, now + hold, member)
    local ms = math.ceil(hold / 1000)
    expireAtLeast(q, ms)
    expireAtLeast(t, ms)
    return {1}
  end
  local expires = tonumber(redis.call('ZSCORE', key, id))
  if expires and expires > now then
    return {2}
  end
  return {0}
end
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
