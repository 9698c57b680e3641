-- Reads buckets without changing them: the admin API's view of a
-- client's buckets. Run with EVAL_RO, so it also works on a replica.
--
-- KEYS[i]      bucket i (only the buckets given: no key is built here)
-- ARGV[3i-2]   its replenish rate, tokens per second
-- ARGV[3i-1]   its burst capacity, whole tokens
-- ARGV[3i]     its requested tokens, whole tokens
--
-- Buckets are read as script.lua stores them; a missing (expired) one is
-- full. Returns for each bucket: the tokens it holds now, as a string
-- (with their fraction), the microseconds until it holds its requested
-- tokens (0 when it does now), and the milliseconds until its key expires
-- (-2 when there is no key).

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local reply = {}
for i = 1, #KEYS do
  local rate = tonumber(ARGV[3 * i - 2])
  local burst = tonumber(ARGV[3 * i - 1])
  local requested = tonumber(ARGV[3 * i])
  local tokens = burst
  local state = redis.call('GET', KEYS[i])
  if state then
    local stored, at = string.match(state, '^(%S+) (%d+)$')
    stored, at = tonumber(stored), tonumber(at)
    if stored and at then
      tokens = math.min(burst, stored + math.max(0, now - at) * rate / 1000000)
    end
  end
  local wait = 0
  if tokens < requested then
    wait = math.ceil((requested - tokens) * 1000000 / rate)
  end
  reply[3 * i - 2] = string.format('%.17g', tokens)
  reply[3 * i - 1] = wait
  reply[3 * i] = redis.call('PTTL', KEYS[i])
end
return reply
