-- Token buckets, quotas and concurrent limits' slots, checked and taken
-- together in one atomic step: a request is admitted only if every
-- bucket and quota holds the tokens it asks and every concurrent limit a
-- free slot, and then all are taken; otherwise none is.
--
-- KEYS[i]      limit i (only the keys given: no key is built here)
-- ARGV         read per key, in order, led by the key's first argument:
--   a token bucket (3 arguments):
--     its replenish rate, tokens per second (may be fractional)
--     its burst capacity, whole tokens (at least 1)
--     its requested tokens, whole tokens (1..burst)
--   a token bucket the request may wait for (5 arguments, max_wait):
--     "w"
--     its replenish rate, burst capacity and requested tokens, as above
--     the request's max wait, whole microseconds (at least 0)
--   a quota (7 arguments, quota.go):
--     "q"
--     its count, whole tokens per period (at least 1)
--     its requested tokens, whole tokens (1..count)
--     four consecutive period boundaries b0 < b1 < b2 < b3, Unix
--     microseconds, computed by Caddy around its clock: the period is
--     [b1, b2) by Caddy's clock; the script picks [b0, b1), [b1, b2) or
--     [b2, b3) by Redis time, and none when Redis time is outside them
--     (the clocks differ by more than a period).
--   a concurrent limit (4 arguments, concurrent.go):
--     "c"
--     its slots n (at least 1)
--     the request's slot id
--     the slot's hold, microseconds
--   a concurrent limit the request may queue for (6 arguments, max_wait):
--     "cq"
--     its slots n, the slot id and the hold, as above
--     the request's priority, a whole number (higher goes first)
--     the channel on which its instance learns that it got its slot
--
-- A bucket is one string "<tokens> <microseconds>": the tokens it held at
-- that Redis time, below zero when a response cost more than it reserved
-- (settle.lua). Tokens refill by elapsed time, so the state only needs
-- writing when tokens are taken. The key expires when the bucket would be
-- full again at the values of the latest request (a denial extends it when
-- they need longer); an expired bucket reads as full, which is what it
-- would be.
--
-- A bucket that has lent tokens (`lease`, lease.lua) carries a mark:
-- "<tokens> <microseconds> <lent> <until>", the tokens its leases held
-- then and the Redis time its last lease expires. Until then it holds at
-- most its burst less what is lent (or less: a lease may expire sooner),
-- and a take keeps the mark; from then on the mark is dropped. So a take
-- here never refills into tokens an instance holds lent, nor takes them
-- after the burst went down (a plan moved by `map`, a reload): the bucket
-- then reads as that burst less what is lent, below zero when more is
-- lent than the burst. It reads one key, as without leases. The key
-- lives until the bucket would be full with every lease expired.
--
-- A quota is one string "<used> <period start, microseconds>": the tokens
-- taken in the period that starts then (more than the count when
-- responses cost more than they reserved: settle.lua). A state of
-- another period reads as nothing used. Its key expires a second after
-- its period ends.
--
-- A concurrent limit is a sorted set of slots: member the slot id of the
-- request that holds it, score its expiry in Redis time (microseconds).
-- Expired slots are free; a request that holds its slot renews it
-- (concurrent.lua) and releases it when its response ended. The key lives
-- until its latest slot expires.
--
-- Returns {allowed (1|0), then for each key: remaining whole tokens
-- (rounded down; 0 in debt or past the count) or free slots, microseconds
-- until it holds its requested tokens again (rounded up; 0 when it holds
-- them now; for a quota, until its period ends; always 0 for slots, which
-- come back by release, not by time); then for each quota, in key order,
-- the period it counted in: -1, 0 or 1 for [b0, b1), [b1, b2) or [b2, b3)
-- (a charged quota's settlement names that one, settle.lua), or Redis
-- time (Unix microseconds) when it lies outside them all: that quota
-- counts in none, and the call takes nothing (allowed 0, and the quota's
-- remaining and wait 0); then, only when some bucket is in the waiting
-- form, for each key: the microseconds the request waits for it before it
-- goes on (0 for one that is not, and all 0 when refused)}; allowed is 2
-- when the request was queued (below). (Buckets with
-- `lease` use lease.lua while their instance holds or wants a lease; it
-- reads and writes them alike.)
--
-- Waiting (issue 40): a bucket in the waiting form that does not hold
-- the request's tokens now admits it when the bucket, less its tokens,
-- would be back to zero within the max wait. The take then takes them
-- now, below zero, and the request waits until then: its go-time. The
-- wait is counted on what the take leaves, so requests go on in the
-- order of their takes, and over any interval T the go-times of a bucket
-- take at most burst + rate * T (the argument is in the token bucket
-- kind's memory.go, TakeWaitingAt, whose arithmetic is this one's). A
-- request that would wait longer takes nothing, from any bucket; its
-- wait word then is the wait a take now would have had (the time until
-- the bucket holds its tokens, but for a lent bucket's cap): it fits
-- within its max wait that much less its max wait from now. A bucket
-- that does not wait reads and answers as it always has.

-- Queueing for a slot (issue 40): a concurrent limit in the queueing
-- form ("cq") whose slots are all taken, when every other bucket of the
-- request admits it, queues the request instead of refusing it: the
-- others are taken now (all or nothing, as ever), and the request enters
-- the limit's queue, two sorted sets beside its slots (the slot key with
-- "|q" and "|t": the same hash tag, so the same Cluster hash slot), of
-- one member per waiter, "<arrival> <n> <hold> <slot id> <channel>":
-- "|q" scores it minus its priority (so the head is the highest
-- priority, then the earliest arrival: members of one score sort by
-- their bytes, and the arrival is Redis time in 16 digits), "|t" its
-- expiry (Redis time plus the hold; the waiter renews it, concurrent.lua
-- 'wait'). The reply's allowed is then 2, the queued limit's remaining 0
-- and its wait word the arrival, which names the member. A queue grants
-- its free slots to its head at once (pump, here and in concurrent.lua:
-- at every release of a queueing limit's slot, every take in the
-- queueing form, every renewal of a waiter): the head's slot is taken
-- under its slot id, for its hold, and "<slot id> <slot key>" published
-- on its channel.
-- Expired members (of a dead instance's waiters) are dropped first. A
-- request queues for one limit at most: two full queueing limits refuse
-- it. A take in the plain form does not look at the queue.

-- Redis time, not the caller's, so instances with skewed clocks agree.
-- 1.7e15 microseconds is well inside a double's exact integers (2^53).
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local n = #KEYS
local rate, burst, requested, tokens, rewound, present = {}, {}, {}, {}, {}, {}
-- waits: by key of a bucket in the waiting form, the microseconds until
-- it, less the request's tokens, is back to zero (0 when it holds them).
-- Made for the first such bucket of a call only.
local waits
-- lent and till: the mark of a bucket whose leases live past now (made
-- for the first such bucket of a call only).
local lent, till
local allowed = 1
local a = 1 -- the index of the key's first argument
-- quota (issue 22): its period's start and end by key (qstart, qend),
-- and which of the three it is (picked: -1, 0, 1); tokens[i] is what it
-- used, burst[i] its count. Made for the first quota of a call only.
local quota, qstart, qend, picked
-- checkQuota reads key i's quota, as the period Redis time is in counts
-- it, and whether it has room for the request.
local function checkQuota(i)
  if not quota then
    quota, qstart, qend, picked = {}, {}, {}, {}
  end
  quota[i] = true
  burst[i] = tonumber(ARGV[a + 1])
  requested[i] = tonumber(ARGV[a + 2])
  local b0, b1, b2, b3 = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  a = a + 7
  -- Redis time picks the period; Caddy's clock may be a little off. Off
  -- by more than a period, no period passed is Redis time's: counting in
  -- one would count in the past or the future (and the count would
  -- expire with a period already over). Count in none, and take nothing.
  if now < b0 or now >= b3 then
    picked[i], allowed = now, 0
    return
  elseif now < b1 then
    qstart[i], qend[i], picked[i] = b0, b1, -1
  elseif now < b2 then
    qstart[i], qend[i], picked[i] = b1, b2, 0
  else
    qstart[i], qend[i], picked[i] = b2, b3, 1
  end
  tokens[i] = 0
  local state = redis.call('GET', KEYS[i])
  if state then
    local used, at = string.match(state, '^(%S+) (%d+)$')
    if tonumber(at) == qstart[i] and tonumber(used) then
      tokens[i] = tonumber(used)
    end
  end
  if tokens[i] + requested[i] > burst[i] then
    allowed = 0
  end
end
-- takeQuota takes what checkQuota found room for, and answers the
-- quota's remaining tokens and wait.
local function takeQuota(i)
  if not qend[i] then -- counted in no period
    return 0, 0
  end
  if allowed == 1 then
    tokens[i] = tokens[i] + requested[i]
    -- The key is of no use once its period ended (Redis time picks the
    -- period, which ends after now); a second of slack.
    local expires = math.floor(qend[i] / 1000) + 1000
    redis.call('SET', KEYS[i], string.format('%.17g %d', tokens[i], qstart[i]), 'PXAT', expires)
  end
  local wait = 0
  if tokens[i] + requested[i] > burst[i] then
    wait = math.max(1, qend[i] - now)
  end
  return math.max(0, math.floor(burst[i] - tokens[i])), wait
end
-- expireAtLeast, pump and enqueue are made where the first bucket that
-- queues is checked, below: a function made on every call of the script
-- costs Redis CPU on every request (made at the top, with untilHolds:
-- BenchmarkScriptsRedisCPU/slots=false 14.1 to 15.9 µs against 12.2 to
-- 13.7 before the waiting forms; made where needed, 13.1 to 13.6).
local expireAtLeast, pump, enqueue
-- concurrent (issue 23): slots, hold and slot id by key; used is the
-- slots held now. Made for the first concurrent limit of a call only.
-- priority and channel: of a limit in the queueing form, by key;
-- queuedAt: the key whose queue the request enters, if any.
local slots, hold, slot, used, priority, channel, queuedAt
local function checkSlots(i, queues)
  if not slots then
    slots, hold, slot, used = {}, {}, {}, {}
  end
  slots[i] = tonumber(ARGV[a + 1])
  slot[i] = ARGV[a + 2]
  hold[i] = tonumber(ARGV[a + 3])
  a = a + 4
  -- An empty set has nothing to purge, and a new one gets its expiry
  -- without asking its TTL (takeSlot): most sets are empty between the
  -- requests of a key (BenchmarkScriptsRedisCPU, slots: 16.7 -> 15.4 µs
  -- of Redis's CPU per request).
  used[i] = redis.call('ZCARD', KEYS[i])
  if used[i] > 0 then -- expired slots are free
    used[i] = used[i] - redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  end
  if queues then
    if not priority then
      priority, channel = {}, {}
    end
    priority[i], channel[i] = tonumber(ARGV[a]), ARGV[a + 1]
    a = a + 2
    -- Those waiting go first.
    used[i] = pump(KEYS[i], used[i])
    if used[i] >= slots[i] and not queuedAt then
      queuedAt = i
      return
    end
  end
  if used[i] >= slots[i] then
    allowed = 0
  end
end
-- takeSlot takes the slot checkSlots found free, and answers the free
-- slots left (and no wait: slots come back by release); the key whose
-- queue the request enters answers 0 and the arrival.
local function takeSlot(i)
  if i == queuedAt then
    if allowed == 1 then
      return 0, enqueue(i)
    end
    return 0, 0
  end
  if allowed == 1 then
    local expires = now + hold[i]
    redis.call('ZADD', KEYS[i], expires, slot[i])
    -- The set lives until its latest slot expires: a set that held no
    -- slot is new, and has no expiry yet.
    local ms = math.ceil(hold[i] / 1000)
    if used[i] == 0 or redis.call('PTTL', KEYS[i]) < ms then
      redis.call('PEXPIRE', KEYS[i], ms)
    end
    used[i] = used[i] + 1
  end
  return math.max(0, slots[i] - used[i]), 0
end

-- untilHolds (made where the first bucket in the waiting form is
-- checked, below, as the queue's functions are) is the microseconds until
-- bucket i, holding t tokens now, holds want (rounded up; 0 when it does
-- now). A lent bucket (its mark) refills only up to its burst less what
-- is lent until its last lease expires. takeBucket has the same
-- arithmetic inline for a call with no bucket that waits.
local untilHolds

-- A token bucket: checkBucket refills key i by the time elapsed and
-- checks it holds the request's tokens, or, with a max wait (the waiting
-- form), would be back to zero within it once they are taken.
local function checkBucket(i, maxwait)
  rate[i] = tonumber(ARGV[a])
  burst[i] = tonumber(ARGV[a + 1])
  requested[i] = tonumber(ARGV[a + 2])
  a = a + 3
  tokens[i] = burst[i]
  local state = redis.call('GET', KEYS[i])
  if state then
    local stored, at, marklent, marktill = string.match(state, '^(%S+) (%d+)$')
    if not stored then
      stored, at, marklent, marktill = string.match(state, '^(%S+) (%d+) (%d+) (%d+)$')
    end
    stored, at = tonumber(stored), tonumber(at)
    if stored and at then
      present[i] = true
      -- After a failover to a server whose clock is behind, the stored
      -- time can lie ahead: count from now instead, and store now (below),
      -- or the bucket would not refill until the clock caught up.
      rewound[i] = at > now
      local from = math.min(at, now)
      if marklent then
        -- Lent: up to the burst less what is lent until the last lease
        -- expires, then up to the burst; tokens above the cap in force
        -- now (the burst went down) come down to it, as in lease.lua.
        marklent, marktill = tonumber(marklent), tonumber(marktill)
        local t = stored
        if marktill > from then
          local to = math.min(marktill, now)
          if t < burst[i] - marklent then
            t = math.min(burst[i] - marklent, t + (to - from) * rate[i] / 1000000)
          end
          from = to
        end
        if t < burst[i] then
          t = math.min(burst[i], t + (now - from) * rate[i] / 1000000)
        end
        if marktill > now then
          t = math.min(t, burst[i] - marklent)
        else
          t = math.min(t, burst[i])
        end
        tokens[i] = t
        if marktill > now then
          if not lent then
            lent, till = {}, {}
          end
          lent[i], till[i] = marklent, marktill
        end
      else
        tokens[i] = math.min(burst[i], stored + (now - from) * rate[i] / 1000000)
      end
    end
  end
  if tokens[i] < requested[i] then
    if maxwait then
      waits[i] = untilHolds(i, tokens[i] - requested[i], 0)
      if waits[i] > maxwait then
        allowed = 0
      end
    else
      allowed = 0
    end
  end
end
-- takeBucket takes the request's tokens when all keys held theirs, and
-- answers the bucket's remaining tokens and wait.
local function takeBucket(i)
  if allowed == 1 then
    tokens[i] = tokens[i] - requested[i]
  end
  -- The key lives as long as its missing tokens take to refill (at
  -- least 1 s), so an idle key lives no longer than needed; a lent one
  -- as long after its last lease expires.
  local fill = math.ceil((burst[i] - tokens[i]) * 1000 / rate[i])
  local marked = lent and lent[i]
  if marked then
    fill = math.max(1000, fill) + math.ceil((till[i] - now) / 1000)
  end
  if marked and (allowed == 1 or rewound[i]) then
    redis.call('SET', KEYS[i], string.format('%.17g %d %d %d', tokens[i], now, lent[i], till[i]), 'PX', fill)
  elseif allowed == 1 or rewound[i] then
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
  if waits then
    if allowed ~= 1 and waits[i] then
      -- Refused, it may wait: the wait a take now would have had.
      return math.max(0, math.floor(tokens[i])), waits[i]
    end
    return math.max(0, math.floor(tokens[i])), untilHolds(i, tokens[i], requested[i])
  end
  local wait = 0
  if tokens[i] < requested[i] then
    wait = math.ceil((requested[i] - tokens[i]) * 1000000 / rate[i])
    if marked then
      -- The cap holds the refill back until the last lease expires.
      local t, cap = tokens[i], burst[i] - lent[i]
      local by = t + (till[i] - now) * rate[i] / 1000000
      if cap < requested[i] or by < requested[i] then
        t = math.min(math.max(t, cap), by)
        wait = till[i] - now + math.max(0, math.ceil((requested[i] - t) * 1000000 / rate[i]))
      end
    end
  end
  return math.max(0, math.floor(tokens[i])), wait
end

-- Check every key, then take from all of them or from none.
for i = 1, n do
  local kind = ARGV[a]
  if kind == 'q' then
    checkQuota(i)
  elseif kind == 'c' then
    checkSlots(i)
  elseif kind == 'cq' then
    if not pump then -- the first bucket that queues makes the queue's functions
      -- expireAtLeast makes key live at least ms milliseconds.
      expireAtLeast = function(key, ms)
        if redis.call('PTTL', key) < ms then
          redis.call('PEXPIRE', key, ms)
        end
      end
      -- pump grants the free slots of the set at key (used of them held, its
      -- expired ones purged) to the heads of its queue, after dropping its
      -- expired members, and answers the slots held then.
      pump = function(key, used)
        local q, t = key .. '|q', key .. '|t'
        if redis.call('ZCARD', t) == 0 then
          return used
        end
        local gone = redis.call('ZRANGEBYSCORE', t, '-inf', now, 'LIMIT', 0, 1000)
        for j = 1, #gone do
          redis.call('ZREM', q, gone[j])
          redis.call('ZREM', t, gone[j])
        end
        while true do
          local head = redis.call('ZRANGE', q, 0, 0)
          if #head == 0 then
            break
          end
          local n, h, id, channel = string.match(head[1], '^%d+ (%d+) (%d+) (%S+) (.+)$')
          n, h = tonumber(n), tonumber(h)
          if not n or used >= n then
            break
          end
          redis.call('ZREM', q, head[1])
          redis.call('ZREM', t, head[1])
          redis.call('ZADD', key, now + h, id)
          expireAtLeast(key, math.ceil(h / 1000))
          redis.call('PUBLISH', channel, id .. ' ' .. key)
          used = used + 1
        end
        return used
      end
      -- enqueue puts the request in key i's queue, and answers its arrival.
      enqueue = function(i)
        local q, t = KEYS[i] .. '|q', KEYS[i] .. '|t'
        local member = string.format('%016d %d %d %s %s', now, slots[i], hold[i], slot[i], channel[i])
        redis.call('ZADD', q, -priority[i], member)
        redis.call('ZADD', t, now + hold[i], member)
        local ms = math.ceil(hold[i] / 1000)
        expireAtLeast(q, ms)
        expireAtLeast(t, ms)
        return now
      end
    end
    checkSlots(i, true)
  elseif kind == 'w' then
    if not waits then
      waits = {}
      untilHolds = function(i, t, want)
      local wait = 0
      if t < want then
        wait = math.ceil((want - t) * 1000000 / rate[i])
        if lent and lent[i] then
          -- The cap holds the refill back until the last lease expires.
          local cap = burst[i] - lent[i]
          local by = t + (till[i] - now) * rate[i] / 1000000
          if cap < want or by < want then
            t = math.min(math.max(t, cap), by)
            wait = till[i] - now + math.max(0, math.ceil((want - t) * 1000000 / rate[i]))
          end
        end
      end
      return wait
      end
    end
    waits[i] = 0
    local maxwait = tonumber(ARGV[a + 4])
    a = a + 1
    checkBucket(i, maxwait)
    a = a + 1
  else
    checkBucket(i)
  end
end
local reply = {allowed}
for i = 1, n do
  if quota and quota[i] then
    reply[2 * i], reply[2 * i + 1] = takeQuota(i)
  elseif slots and slots[i] then
    reply[2 * i], reply[2 * i + 1] = takeSlot(i)
  else
    reply[2 * i], reply[2 * i + 1] = takeBucket(i)
  end
end
if quota then
  local k = 2 * n + 1
  for i = 1, n do
    if quota[i] then
      k = k + 1
      reply[k] = picked[i]
    end
  end
end
if waits then
  local k = #reply
  for i = 1, n do
    reply[k + i] = (allowed == 1 and waits[i]) or 0
  end
end
if queuedAt and allowed == 1 then
  reply[1] = 2
end
return reply
