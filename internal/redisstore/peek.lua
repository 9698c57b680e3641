-- Reads buckets without changing them: the admin API's view of a
-- client's buckets. Run with EVAL_RO, so it also works on a replica.
--
-- KEYS[i]      bucket i (only the buckets given: no key is built here)
-- ARGV         read per key as script.lua reads them: a token bucket's
--              rate, burst and requested tokens (3; or 5 in the
--              waiting form, "w" first and the max wait last, which
--              changes nothing here), or a quota's "q", count,
--              requested tokens and four boundaries (7)
--
-- Buckets are read as script.lua stores them and reads them; a missing
-- (expired) one is full; a bucket that has lent (`lease`, lease.lua's
-- mark) holds at most its burst less what is lent until its last lease
-- expires, so what is shown is what another instance can take from it;
-- a quota holds its count less what it used in the period Redis time
-- picks. Returns for each bucket: the tokens it holds now, as a string
-- (with their fraction), the microseconds until it holds its requested
-- tokens (0 when it does now), the milliseconds until its key expires
-- (-2 when there is no key), and the tokens its mark says are lent (0
-- without a mark, or once its last lease expired; always 0 for a quota).

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local reply = {}
local a = 1
for i = 1, #KEYS do
  local state = redis.call('GET', KEYS[i])
  local tokens, wait, lent = nil, nil, 0
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
    local waiting = ARGV[a] == 'w' -- the waiting form: its max wait follows
    if waiting then
      a = a + 1
    end
    local rate = tonumber(ARGV[a])
    local burst = tonumber(ARGV[a + 1])
    local requested = tonumber(ARGV[a + 2])
    a = a + 3
    if waiting then
      a = a + 1
    end
    tokens = burst
    local till
    if state then
      local stored, at, marklent, marktill = string.match(state, '^(%S+) (%d+)$')
      if not stored then
        stored, at, marklent, marktill = string.match(state, '^(%S+) (%d+) (%d+) (%d+)$')
      end
      stored, at = tonumber(stored), tonumber(at)
      if stored and at then
        local from = math.min(at, now)
        if marklent then
          -- As script.lua: up to the burst less what is lent until the
          -- last lease expires, then up to the burst; never above the
          -- cap in force now.
          marklent, marktill = tonumber(marklent), tonumber(marktill)
          local t = stored
          if marktill > from then
            local to = math.min(marktill, now)
            if t < burst - marklent then
              t = math.min(burst - marklent, t + (to - from) * rate / 1000000)
            end
            from = to
          end
          if t < burst then
            t = math.min(burst, t + (now - from) * rate / 1000000)
          end
          if marktill > now then
            t = math.min(t, burst - marklent)
            lent, till = marklent, marktill
          else
            t = math.min(t, burst)
          end
          tokens = t
        else
          tokens = math.min(burst, stored + (now - from) * rate / 1000000)
        end
      end
    end
    wait = 0
    if tokens < requested then
      wait = math.ceil((requested - tokens) * 1000000 / rate)
      if till then
        -- As script.lua: the cap holds the refill back until the last
        -- lease expires.
        local t, cap = tokens, burst - lent
        local by = t + (till - now) * rate / 1000000
        if cap < requested or by < requested then
          t = math.min(math.max(t, cap), by)
          wait = till - now + math.max(0, math.ceil((requested - t) * 1000000 / rate))
        end
      end
    end
  end
  reply[4 * i - 3] = string.format('%.17g', tokens)
  reply[4 * i - 2] = wait
  reply[4 * i - 1] = redis.call('PTTL', KEYS[i])
  reply[4 * i] = lent
end
return reply
