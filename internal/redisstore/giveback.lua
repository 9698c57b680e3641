-- Gives tokens back to buckets: a request took them, then another group
-- of its buckets (on another Redis Cluster master) refused, so none may
-- stay taken. A bucket given back what was taken, capped at its burst, is
-- never fuller than it would have been had they not been taken.
--
-- KEYS[i]      bucket i (only the buckets given: no key is built here)
-- ARGV         read per key as script.lua reads them, the requested
--              tokens being the tokens to give back: a token bucket's
--              rate, burst and tokens (3; 5 in the waiting form, "w"
--              first and the max wait last), or a quota's "q", count,
--              tokens and four boundaries (7)
--
-- Buckets are stored as script.lua stores them; a missing (expired)
-- bucket is full and stays so. A quota gets its tokens back in the period
-- Redis time picks, if it counts that one (not below nothing used).
-- Returns {buckets written}.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local written = 0
local a = 1
for i = 1, #KEYS do
  local state = redis.call('GET', KEYS[i])
  if ARGV[a] == 'q' then
    local given = tonumber(ARGV[a + 2])
    local b0, b1, b2, b3 = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
    a = a + 7
    local start = b1
    if now < b1 then
      start = b0
    elseif now >= b2 then
      start = b2
    end
    if state then
      local used, at = string.match(state, '^(%S+) (%d+)$')
      used, at = tonumber(used), tonumber(at)
      if used and at == start then
        redis.call('SET', KEYS[i], string.format('%.17g %d', math.max(0, used - given), at), 'KEEPTTL')
        written = written + 1
      end
    end
  else
    local waiting = ARGV[a] == 'w' -- the waiting form: its max wait follows
    if waiting then
      a = a + 1
    end
    local rate = tonumber(ARGV[a])
    local burst = tonumber(ARGV[a + 1])
    local given = tonumber(ARGV[a + 2])
    a = a + 3
    if waiting then
      a = a + 1
    end
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
end
return {written}
