-- Token buckets, checked and taken together in one atomic step: a
-- request is admitted only if every bucket holds the tokens it asks, and
-- then all are taken; otherwise none is.
--
-- KEYS[i]      limit i (only the keys given: no key is built here)
-- ARGV         read per key with a moving index, led by the key's first
--              argument:
--   a number   a token bucket: its replenish rate, tokens per second (may
--              be fractional), its burst capacity, whole tokens (at least
--              1), its requested tokens, whole tokens (1..burst)
--   "c"        a concurrent limit (issue 23): "c", its slots n (at least
--              1), the request's slot id, its hold in microseconds
--
-- A bucket is one string "<tokens> <microseconds>": the tokens it held at
-- that Redis time, below zero when a response cost more than it reserved
-- (settle.lua). Tokens refill by elapsed time, so the state only needs
-- writing when tokens are taken. The key expires when the bucket would be
-- full again at the values of the latest request (a denial extends it when
-- they need longer); an expired bucket reads as full, which is what it
-- would be.
--
-- A concurrent limit is a sorted set of slots: member the slot id of the
-- request that holds it, score its expiry in Redis time (microseconds).
-- Expired slots are free; a request that holds its slot renews it
-- (concurrent.lua) and releases it when its response ended. The key lives
-- until its latest slot expires.
--
-- Returns {allowed (1|0), then for each key: remaining whole tokens
-- (rounded down; 0 in debt) or free slots, microseconds until it holds its
-- requested tokens again (rounded up; 0 when it holds them now; always 0
-- for slots, which come back by release, not by time)}. (Buckets with
-- `lease` use lease.lua, which reads and writes them alike.)

-- Redis time, not the caller's, so instances with skewed clocks agree.
-- 1.7e15 microseconds is well inside a double's exact integers (2^53).
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local n = #KEYS
local rate, burst, requested, tokens, rewound, present = {}, {}, {}, {}, {}, {}
local allowed = 1
local a = 1 -- the index of the key's first argument
-- concurrent (issue 23): slots, hold and slot id by key; used is the
-- slots held now.
local slots, hold, slot, used = {}, {}, {}, {}
local function checkSlots(i)
  slots[i] = tonumber(ARGV[a + 1])
  slot[i] = ARGV[a + 2]
  hold[i] = tonumber(ARGV[a + 3])
  a = a + 4
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now) -- expired slots are free
  used[i] = redis.call('ZCARD', KEYS[i])
  if used[i] >= slots[i] then
    allowed = 0
  end
end
local function takeSlot(i)
  local expires = now + hold[i]
  redis.call('ZADD', KEYS[i], expires, slot[i])
  local ms = math.ceil(hold[i] / 1000)
  if redis.call('PTTL', KEYS[i]) < ms then
    redis.call('PEXPIRE', KEYS[i], ms)
  end
  used[i] = used[i] + 1
end
for i = 1, n do
  if ARGV[a] == 'c' then
    checkSlots(i)
  else
  rate[i] = tonumber(ARGV[a])
  burst[i] = tonumber(ARGV[a + 1])
  requested[i] = tonumber(ARGV[a + 2])
  a = a + 3
  tokens[i] = burst[i]
  local state = redis.call('GET', KEYS[i])
  if state then
    local stored, at = string.match(state, '^(%S+) (%d+)$')
    stored, at = tonumber(stored), tonumber(at)
    if stored and at then
      present[i] = true
      -- After a failover to a server whose clock is behind, the stored
      -- time can lie ahead: count from now instead, and store now (below),
      -- or the bucket would not refill until the clock caught up.
      rewound[i] = at > now
      tokens[i] = math.min(burst[i], stored + math.max(0, now - at) * rate[i] / 1000000)
    end
  end
  if tokens[i] < requested[i] then
    allowed = 0
  end
  end
end

local reply = {allowed}
for i = 1, n do
  if slots[i] then
    if allowed == 1 then
      takeSlot(i)
    end
    reply[2 * i] = math.max(0, slots[i] - used[i])
    reply[2 * i + 1] = 0
  else
  if allowed == 1 then
    tokens[i] = tokens[i] - requested[i]
  end
  -- The key lives as long as its missing tokens take to refill (at
  -- least 1 s), so an idle key lives no longer than needed.
  local fill = math.ceil((burst[i] - tokens[i]) * 1000 / rate[i])
  if allowed == 1 or rewound[i] then
    redis.call('SET', KEYS[i], string.format('%.17g %d', tokens[i], now), 'PX', math.max(1000, fill))
  elseif present[i] then
    -- A denial stores nothing, but the key's expiry was set at the values
    -- of the request that wrote it: after a move to a slower plan it would
    -- expire, and read full, before the bucket refilled at the rate now
    -- in force. Then it lives until then. (1 ms of slack for the TTL's
    -- rounding: at unchanged values a denial writes nothing.)
    local pttl = redis.call('PTTL', KEYS[i])
    if pttl >= 0 and pttl + 1 < fill then
      redis.call('PEXPIRE', KEYS[i], math.max(1000, fill))
    end
  end
  local wait = 0
  if tokens[i] < requested[i] then
    wait = math.ceil((requested[i] - tokens[i]) * 1000000 / rate[i])
  end
  reply[2 * i] = math.max(0, math.floor(tokens[i]))
  reply[2 * i + 1] = wait
  end
end
return reply
