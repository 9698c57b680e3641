-- Reads buckets without changing them: the admin API's view of a
-- client's buckets. Run with EVAL_RO, so it also works on a replica.
--
-- KEYS[i]      bucket i (only the buckets given: no key is built here)
-- ARGV         read per key as script.lua reads them: a token bucket's
--              rate, burst and requested tokens (3), or a quota's "q",
--              count, requested tokens and four boundaries (7)
--
-- Buckets are read as script.lua stores them; a missing (expired) one is
-- full; a quota holds its count less what it used in the period Redis
-- time picks. Returns for each bucket: the tokens it holds now, as a string
-- (with their fraction), the microseconds until it holds its requested
-- tokens (0 when it does now), and the milliseconds until its key expires
-- (-2 when there is no key).

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local reply = {}
local a = 1
for i = 1, #KEYS do
  local state = redis.call('GET', KEYS[i])
  local tokens, wait
  if ARGV[a] == 'q' then
    local count = tonumber(ARGV[a + 1])
    local requested = tonumber(ARGV[a + 2])
    local b0, b1, b2, b3 = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
    a = a + 7
    local start, stop = b1, b2
    if now < b1 then
      start, stop = b0, b1
    elseif now >= b2 then
      start, stop = b2, b3
    end
    local used = 0
    if state then
      local u, at = string.match(state, '^(%S+) (%d+)$')
      if tonumber(at) == start and tonumber(u) then
        used = tonumber(u)
      end
    end
    tokens, wait = count - used, 0
    if used + requested > count then
      wait = math.max(1, stop - now)
    end
  else
    local rate = tonumber(ARGV[a])
    local burst = tonumber(ARGV[a + 1])
    local requested = tonumber(ARGV[a + 2])
    a = a + 3
    tokens = burst
    if state then
      -- (a lending bucket's mark, after these, is not read: the view is
      -- of the tokens in the bucket, without what it has lent)
      local stored, at = string.match(state, '^(%S+) (%d+)')
      stored, at = tonumber(stored), tonumber(at)
      if stored and at then
        tokens = math.min(burst, stored + math.max(0, now - at) * rate / 1000000)
      end
    end
    wait = 0
    if tokens < requested then
      wait = math.ceil((requested - tokens) * 1000000 / rate)
    end
  end
  reply[3 * i - 2] = string.format('%.17g', tokens)
  reply[3 * i - 1] = wait
  reply[3 * i] = redis.call('PTTL', KEYS[i])
end
return reply
