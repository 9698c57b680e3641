-- Gives tokens back to buckets: a request took them, then another group
-- of its buckets (on another Redis Cluster master) refused, so none may
-- stay taken. A bucket given back what was taken, capped at its burst, is
-- never fuller than it would have been had they not been taken.
--
-- KEYS[i]      bucket i (only the buckets given: no key is built here)
-- ARGV[3i-2]   its replenish rate, tokens per second
-- ARGV[3i-1]   its burst capacity, whole tokens
-- ARGV[3i]     the tokens to give back, whole tokens
--
-- Buckets are stored as script.lua stores them; a missing (expired)
-- bucket is full and stays so. Returns {buckets written}.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local written = 0
for i = 1, #KEYS do
  local rate = tonumber(ARGV[3 * i - 2])
  local burst = tonumber(ARGV[3 * i - 1])
  local given = tonumber(ARGV[3 * i])
  local state = redis.call('GET', KEYS[i])
  if state then
    local stored, at = string.match(state, '^(%S+) (%d+)$')
    stored, at = tonumber(stored), tonumber(at)
    if stored and at then
      local tokens = math.min(burst, stored + math.max(0, now - at) * rate / 1000000 + given)
      local ttl = math.max(1000, math.ceil((burst - tokens) * 1000 / rate))
      redis.call('SET', KEYS[i], string.format('%.17g %d', tokens, now), 'PX', ttl)
      written = written + 1
    end
  end
end
return {written}
