-- Token bucket, checked and taken in one atomic step.
--
-- KEYS[1]  the bucket
-- ARGV[1]  replenish rate, tokens per second (may be fractional)
-- ARGV[2]  burst capacity, whole tokens (at least 1)
-- ARGV[3]  requested tokens, whole tokens (1..burst)
--
-- The bucket is one string "<tokens> <microseconds>": the tokens it held at
-- that Redis time. Tokens refill by elapsed time, so the state only needs
-- writing when tokens are taken; a denial changes nothing.
--
-- Returns {allowed (1|0), remaining whole tokens (rounded down),
-- microseconds until the bucket holds the requested tokens again, rounded
-- up (0 when it holds them now)}.

local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local requested = tonumber(ARGV[3])

-- Redis time, not the caller's, so instances with skewed clocks agree.
-- 1.7e15 microseconds is well inside a double's exact integers (2^53).
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

-- A new or expired bucket is full: an expired one was idle long enough
-- to have filled up, because the TTL is twice the time to fill.
local tokens = burst
local state = redis.call('GET', KEYS[1])
if state then
  local stored, at = string.match(state, '^(%S+) (%d+)$')
  stored, at = tonumber(stored), tonumber(at)
  if stored and at then
    local elapsed = math.max(0, now - at)
    tokens = math.min(burst, stored + elapsed * rate / 1000000)
  end
end

if tokens < requested then
  local wait = math.ceil((requested - tokens) * 1000000 / rate)
  return {0, math.floor(tokens), wait}
end

tokens = tokens - requested
local fill_ms = math.ceil(burst * 1000 / rate)
local ttl = math.max(1000, 2 * fill_ms)
redis.call('SET', KEYS[1], string.format('%.17g %d', tokens, now), 'PX', ttl)
local wait = 0
if tokens < requested then
  wait = math.ceil((requested - tokens) * 1000000 / rate)
end
return {1, math.floor(tokens), wait}
