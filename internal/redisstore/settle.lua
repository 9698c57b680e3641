-- Settles what responses really cost: each request took its reservation
-- (requested tokens, script.lua); once its response said the real cost,
-- the difference is taken or given back here. A larger cost takes the
-- rest even below zero, down to -max_debt (beyond that it is forgiven); a
-- smaller one gives tokens back, capped at the burst as any give-back, so
-- a bucket is never fuller than it would have been.
--
-- KEYS[i]      bucket i (only the buckets given: no key is built here)
-- ARGV[4i-3]   its replenish rate, tokens per second
-- ARGV[4i-2]   its burst capacity, whole tokens
-- ARGV[4i-1]   the difference, whole tokens: cost less reservation (a
--              positive one is taken, a negative one given back)
-- ARGV[4i]     its max debt, whole tokens (0 or more): a take leaves the
--              bucket no lower than minus this, and never raises it
--
-- A quota (quota.go) comes as "q<start>" (the start, Unix microseconds,
-- of the period its reservation was taken in), its count, the difference and its max
-- debt: a take adds to what it used, even past the count, up to count +
-- max_debt (beyond that it is forgiven, and it never lowers what is
-- used); a give-back takes from what it used, down to nothing. It is
-- settled in the period its key counts, with the key's expiry, when that
-- is the reservation's period (the one script.lua answered it counted
-- in); a quota without a key (its period over, or reset) or counting
-- another period has nothing to settle, and answers so.
--
-- Buckets are read and stored as script.lua stores them, negative tokens
-- included (debt); a missing (expired) bucket is full. A written key
-- lives until the bucket would be full again, from debt too.
--
-- Returns {for each bucket: the tokens forgiven, what a take could not
-- take past -max_debt, as whole tokens and millionths (both rounded
-- down): a bucket refills by fractions, so what is forgiven has one}; or
-- -1, 0 for a bucket that could not be settled (its key holds another
-- type, or the write was refused): one call may settle the buckets of
-- several requests, and one such bucket must not fail the others; or
-- -2, 0 for a quota with nothing to settle (its reservation's period is
-- no longer counted): the reservation is what it charged.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

-- settleQuota is a quota's settlement: its reply pair.
local function settleQuota(key, start, count, diff, maxDebt)
  local state = redis.pcall('GET', key)
  if type(state) == 'table' then
    return -1, 0
  end
  if not state then
    return -2, 0
  end
  local used, at = string.match(state, '^(%S+) (%d+)$')
  used = tonumber(used)
  if not used or tonumber(at) ~= start then -- another period than the reservation's
    return -2, 0
  end
  local left, forgiven = math.max(0, used + diff), 0
  local ceiling = math.max(used, count + maxDebt)
  if left > ceiling then
    forgiven, left = left - ceiling, ceiling
  end
  local written = redis.pcall('SET', key, string.format('%.17g %s', left, at), 'KEEPTTL')
  if written.err ~= nil then
    return -1, 0
  end
  local whole = math.floor(forgiven)
  return whole, math.floor((forgiven - whole) * 1000000)
end

local reply = {}
for i = 1, #KEYS do
  local kind = ARGV[4 * i - 3]
  if string.sub(kind, 1, 1) == 'q' then
    reply[2 * i - 1], reply[2 * i] = settleQuota(KEYS[i], tonumber(string.sub(kind, 2)), tonumber(ARGV[4 * i - 2]),
      tonumber(ARGV[4 * i - 1]), tonumber(ARGV[4 * i]))
  else
    local rate = tonumber(ARGV[4 * i - 3])
    local burst = tonumber(ARGV[4 * i - 2])
    local diff = tonumber(ARGV[4 * i - 1])
    local maxDebt = tonumber(ARGV[4 * i])
    local tokens = burst
    local state = redis.pcall('GET', KEYS[i])
    local failed = type(state) == 'table' -- an error: GET answers a string or false otherwise
    if failed then
      state = nil
    end
    if state then
      local stored, at = string.match(state, '^(%S+) (%d+)$')
      stored, at = tonumber(stored), tonumber(at)
      if stored and at then
        tokens = math.min(burst, stored + math.max(0, now - at) * rate / 1000000)
      end
    end
    local left, forgiven = tokens, 0
    if diff < 0 then
      left = math.min(burst, tokens - diff)
    else
      left = tokens - diff
      local floor = math.min(tokens, -maxDebt)
      if left < floor then
        forgiven = floor - left
        left = floor
      end
    end
    if not failed and (state or left < burst) then
      local ttl = math.max(1000, math.ceil((burst - left) * 1000 / rate))
      local written = redis.pcall('SET', KEYS[i], string.format('%.17g %d', left, now), 'PX', ttl)
      failed = written.err ~= nil -- SET answers a status ({ok = 'OK'}) or an error, both tables
    end
    if failed then
      reply[2 * i - 1], reply[2 * i] = -1, 0
    else
      local whole = math.floor(forgiven)
      reply[2 * i - 1] = whole
      reply[2 * i] = math.floor((forgiven - whole) * 1000000)
    end
  end
end
return reply
