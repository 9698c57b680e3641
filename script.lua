-- Token buckets, checked and taken together in one atomic step: a
-- request is admitted only if every bucket holds the tokens it asks, and
-- then all are taken; otherwise none is.
--
-- KEYS[i]      bucket i (only the buckets given: no key is built here)
-- ARGV[3i-2]   its replenish rate, tokens per second (may be fractional)
-- ARGV[3i-1]   its burst capacity, whole tokens (at least 1)
-- ARGV[3i]     its requested tokens, whole tokens (1..burst)
--
-- A bucket is one string "<tokens> <microseconds>": the tokens it held at
-- that Redis time, below zero when a response cost more than it reserved
-- (settle.lua). Tokens refill by elapsed time, so the state only needs
-- writing when tokens are taken. The key expires when the bucket would be
-- full again at the values of the latest request (a denial extends it when
-- they need longer); an expired bucket reads as full, which is what it
-- would be.
--
-- Returns {allowed (1|0), then for each bucket: remaining whole tokens
-- (rounded down; 0 in debt), microseconds until it holds its requested
-- tokens again (rounded up; 0 when it holds them now)}. (Buckets with
-- `lease` use lease.lua, which reads and writes them alike.)

-- Redis time, not the caller's, so instances with skewed clocks agree.
-- 1.7e15 microseconds is well inside a double's exact integers (2^53).
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local n = #KEYS
local rate, burst, requested, tokens, rewound, present = {}, {}, {}, {}, {}, {}
local allowed = 1
for i = 1, n do
  rate[i] = tonumber(ARGV[3 * i - 2])
  burst[i] = tonumber(ARGV[3 * i - 1])
  requested[i] = tonumber(ARGV[3 * i])
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

local reply = {allowed}
for i = 1, n do
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
return reply
