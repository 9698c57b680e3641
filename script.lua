-- Token bucket, checked and taken in one atomic step.
--
-- KEYS[1]  the bucket
-- ARGV[1]  replenish rate, tokens per second (may be fractional)
-- ARGV[2]  burst capacity, whole tokens (at least 1)
-- ARGV[3]  requested tokens, whole tokens (1..burst)
--
-- The bucket is one string "<tokens> <microseconds>": the tokens it held at
-- that Redis time. Tokens refill by elapsed time, so the state only needs
-- writing when tokens are taken. The key expires when the bucket would be
-- full again; an expired bucket reads as full, which is what it would be.
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

local tokens = burst
local rewound = false
local state = redis.call('GET', KEYS[1])
if state then
  local stored, at = string.match(state, '^(%S+) (%d+)$')
  stored, at = tonumber(stored), tonumber(at)
  if stored and at then
    -- After a failover to a server whose clock is behind, the stored time
    -- can lie ahead: count from now instead, and store now (below), or
    -- the bucket would not refill until the clock caught up.
    rewound = at > now
    tokens = math.min(burst, stored + math.max(0, now - at) * rate / 1000000)
  end
end

-- store writes the bucket with a TTL of the time its missing tokens take
-- to refill (at least 1 s), so an idle key lives no longer than needed.
local function store()
  local ttl = math.max(1000, math.ceil((burst - tokens) * 1000 / rate))
  redis.call('SET', KEYS[1], string.format('%.17g %d', tokens, now), 'PX', ttl)
end

if tokens < requested then
  if rewound then
    store()
  end
  local wait = math.ceil((requested - tokens) * 1000000 / rate)
  return {0, math.floor(tokens), wait}
end

tokens = tokens - requested
store()
local wait = 0
if tokens < requested then
  wait = math.ceil((requested - tokens) * 1000000 / rate)
end
return {1, math.floor(tokens), wait}
