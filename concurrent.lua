-- Slots of concurrent limits (issue 23), renewed or released by the
-- request that holds them. A slot is a member of its limit's sorted set
-- (script.lua takes it), scored with its expiry in Redis time.
--
-- KEYS[i]      the sorted set of concurrent limit i
-- ARGV[1]      "renew" or "release"
-- a renewal:
--   ARGV[2i]     the request's slot id in KEYS[i]
--   ARGV[2i+1]   its limit's hold, in microseconds: a renewed slot
--                expires then
-- a release:
--   ARGV[i+1]    the request's slot id in KEYS[i]
--
-- A renewal never brings a slot back: one that has expired is free, may
-- have been taken by another request already, and is dropped instead. A
-- release removes the slot; one released twice, or expired, is gone
-- already.
--
-- Returns, for each key: 1 when the slot was renewed or released, 0 when
-- it was gone.

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
  local id, hold = ARGV[2 * i], tonumber(ARGV[2 * i + 1])
  local expires = tonumber(redis.call('ZSCORE', KEYS[i], id))
  if expires and expires > now then
    redis.call('ZADD', KEYS[i], 'XX', now + hold, id)
    local ms = math.ceil(hold / 1000)
    if redis.call('PTTL', KEYS[i]) < ms then
      redis.call('PEXPIRE', KEYS[i], ms)
    end
    reply[i] = 1
  else
    if expires then
      redis.call('ZREM', KEYS[i], id) -- expired: free, not to come back
    end
    reply[i] = 0
  end
end
return reply
