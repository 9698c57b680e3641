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
--   ARGV[3i+1]   its limit's slots n
-- a release:
--   ARGV[i+1]    the request's slot id in KEYS[i]
--
-- A renewal of a slot that is gone (expired, freed by the admin API, or
-- lost with Redis's data: FLUSHALL, a restart without persistence, a
-- failover to a replica that had not seen it) brings it back while
-- fewer than n slots are live, so the request counts again and never
-- more than n are held; otherwise the slot is dropped, and the next
-- renewal tries again. A release removes the slot; one released twice,
-- or expired, is gone already.
--
-- Returns, for each key: 1 when the slot was renewed or released, 2 when
-- a renewal brought it back, 0 when it was gone (and, for a renewal,
-- every slot taken).

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
  if reply[i] > 0 then
    redis.call('ZADD', KEYS[i], now + hold, id)
    local ms = math.ceil(hold / 1000)
    if redis.call('PTTL', KEYS[i]) < ms then
      redis.call('PEXPIRE', KEYS[i], ms)
    end
  end
end
return reply
