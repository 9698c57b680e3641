-- Token buckets that lend tokens to Caddy instances (`lease`), counting
-- in Redis what each instance holds, so that a bucket never refills into
-- lent tokens: tokens in the bucket plus tokens lent and unexpired never
-- exceed the burst, and over any interval T a bucket admits at most
-- burst + rate * T, wherever its tokens were spent. A call with a lower
-- burst than the bucket was filled under (a plan moved by `map`, a
-- reload) first brings the bucket, and the caller's lease, down to it.
--
-- KEYS[2i-1]   bucket i, stored as script.lua stores it: "<tokens> <µs>",
--              or, while it has lent, "<tokens> <µs> <lent> <until µs>":
--              the tokens its leases held then and when the last expires
--              (the mark, which script.lua keeps and refills under)
-- KEYS[2i]     what bucket i has lent, in the same Cluster hash slot: one
--              "<instance> <tokens> <expiry µs> <seq>" per lease, joined
--              by ","; the key expires with its last lease. It is read
--              only when its bucket's mark says a lease lives, and
--              written only when one does: a bucket without leases costs
--              what it costs script.lua, one key read and written.
-- ARGV[1]      what the call does:
--                take    the caller's request waits: take its requested
--                        tokens from every bucket, all or none; then, if
--                        admitted, report and lend as renew does
--                renew   report what the caller's lease still holds, and
--                        lend it more
--                give    give the lease back: its unused tokens return to
--                        the bucket, and the bucket lends nothing to the
--                        caller any more
--                refund  return each bucket's requested tokens, taken by a
--                        request that another slot group then refused
--                reset   make each bucket full less what is lent (the
--                        admin API's reset: deleting the bucket would
--                        drop its mark, and with it what is lent)
--                settle  settle what responses cost (charge): take each
--                        bucket's difference (its requested tokens here),
--                        down to minus its max debt (its held tokens
--                        here), or give it back (a negative difference)
--                        up to what the leases leave; the reply's last
--                        part is then the tokens forgiven past the debt
-- ARGV[2]      the calling instance (letters and digits)
-- ARGV[3]      the call's sequence number, increasing on that instance: a
--              call older than the last one seen reports nothing (calls
--              of one instance may overtake each other after a timeout);
--              a give-back, numbered when its leases were picked, is
--              judged bucket by bucket: it leaves a bucket that a later
--              call reached (a new lease taken before it arrived) as
--              that call left it, and gives back the others
-- ARGV[4]      how long, in µs, a lease lives here after a call: the
--              caller's hold plus a grace for its give-back to arrive.
--              A lease that expires without a give-back (its instance
--              died) counts as spent at its expiry.
-- ARGV[5i..5i+4]  bucket i: replenish rate (tokens per second), burst
--              capacity, requested tokens (whole), the tokens the
--              caller's lease holds unused (as the call left), and the
--              most tokens the caller's lease should hold after the call
--
-- Lending: never more than half of what the bucket holds after the
-- request (a lease shrinks to nothing as the bucket runs low), and all of
-- a call's buckets lend up to the same number of requests (the fewest
-- any of them can reach): a request is admitted from leases only when
-- every one of its buckets' leases holds its tokens.
--
-- Returns {allowed (1|0: take; else 1), then for each bucket: remaining
-- whole tokens (rounded down), µs until it holds its requested tokens
-- (rounded up; 0 when it holds them now); then for each bucket: the
-- tokens it counts as lent to the caller after the call (settle: the
-- tokens forgiven)}.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local mode, me, seq, life = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local n = #KEYS / 2

-- The leases of a bucket, soonest expiry first.
local function readLeases(key)
  local leases = {}
  local text = redis.call('GET', key)
  if text then
    for id, tokens, expiry, s in string.gmatch(text, '(%w+) (%d+) (%d+) (%d+)') do
      leases[#leases + 1] = {id = id, tokens = tonumber(tokens), expiry = tonumber(expiry), seq = tonumber(s)}
    end
  end
  table.sort(leases, function(a, b) return a.expiry < b.expiry end)
  return leases
end

-- What the leases that live past t hold.
local function lentAt(leases, t)
  local lent = 0
  for _, l in ipairs(leases) do
    if l.expiry > t then
      lent = lent + l.tokens
    end
  end
  return lent
end

-- Refills tokens from time from to time to at rate, up to the burst less
-- what is lent; each lease that expires on the way raises that cap from
-- its expiry on. Tokens above the cap are not refilled (they come down
-- to it once the caller's lease is counted: see the burst in force,
-- below).
local function refill(tokens, from, to, rate, burst, leases)
  local lent = lentAt(leases, from)
  local function grow(till)
    local cap = burst - lent
    if tokens < cap then
      tokens = math.min(cap, tokens + (till - from) * rate / 1000000)
    end
    from = till
  end
  for _, l in ipairs(leases) do
    if l.expiry > from and l.expiry <= to then
      grow(l.expiry)
      lent = lent - l.tokens
    end
  end
  grow(to)
  return tokens
end

-- µs from now until tokens reach need, by refill alone, as the leases
-- (all unexpired) expire.
local function waitFor(tokens, need, rate, burst, leases)
  local lent, t = lentAt(leases, now), now
  for _, l in ipairs(leases) do
    if burst - lent >= need and tokens + (l.expiry - t) * rate / 1000000 >= need then
      break
    end
    tokens = math.min(math.max(tokens, burst - lent), tokens + (l.expiry - t) * rate / 1000000)
    lent, t = lent - l.tokens, l.expiry
  end
  return t - now + math.ceil((need - tokens) * 1000000 / rate)
end

local rate, burst, requested, held, want = {}, {}, {}, {}, {}
local tokens, leases, own, forgiven, stale, recorded, reported = {}, {}, {}, {}, {}, {}, {}
local allowed, fresh = 1, true
for i = 1, n do
  local a = 4 + 5 * (i - 1)
  rate[i], burst[i], requested[i] = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  held[i], want[i] = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  local state = redis.call('GET', KEYS[2 * i - 1])
  local stored, at, marklent, marktill
  if state then
    stored, at = string.match(state, '^(%S+) (%d+)$')
    if not stored then
      stored, at, marklent, marktill = string.match(state, '^(%S+) (%d+) (%d+) (%d+)$')
      marklent, marktill = tonumber(marklent), tonumber(marktill)
    end
    stored, at = tonumber(stored), tonumber(at)
  end
  -- The leases: none without a mark; from the record while the mark says
  -- one lives. A mark whose leases all expired (or whose record was
  -- lost) stands for one lease of all it counted, until its end: the
  -- bucket refills under it until then, as script.lua refills it.
  leases[i] = {}
  if marktill and marktill > now then
    leases[i], recorded[i] = readLeases(KEYS[2 * i]), true
  end
  if marktill and #leases[i] == 0 then
    leases[i][1] = {id = '0', tokens = marklent, expiry = marktill, seq = 0}
  end
  if stored and at then
    -- A stored time ahead of now (a failover to a server whose clock is
    -- behind) counts from now, as in script.lua.
    tokens[i] = refill(stored, math.min(at, now), now, rate[i], burst[i], leases[i])
  else
    -- An absent bucket is full: up to what is lent.
    tokens[i] = burst[i] - lentAt(leases[i], now)
  end
  -- Expired leases are spent; the caller's own is looked up.
  local live = {}
  for _, l in ipairs(leases[i]) do
    if l.expiry > now then
      live[#live + 1] = l
      if l.id == me then
        own[i] = l
      end
    end
  end
  leases[i] = live
  if own[i] and own[i].seq >= seq then
    stale[i], fresh = true, false
  end
end

-- The caller's report: its lease holds what it says, never more than
-- counted here (what it used is spent, and leaves the lent total). A
-- lease this bucket does not count (expired, or lost with the data)
-- holds nothing: the reply tells the caller so.
-- An answered report renews the lease's life here, as the caller renews
-- its hold. A give-back reports bucket by bucket (see ARGV[3]); a take or
-- renewal, which lends to all its buckets in lockstep, all or nothing.
if (fresh or mode == 'give') and mode ~= 'refund' and mode ~= 'settle' and mode ~= 'reset' then
  for i = 1, n do
    if own[i] and not stale[i] then
      reported[i] = true
      own[i].tokens, own[i].expiry, own[i].seq = math.min(held[i], own[i].tokens), now + life, seq
      if mode == 'give' then
        -- Up to the cap it frees: never past it, even if an instance
        -- without lease refilled the bucket into lent tokens.
        local cap = burst[i] - lentAt(leases[i], now) + own[i].tokens
        if tokens[i] < cap then
          tokens[i] = math.min(cap, tokens[i] + own[i].tokens)
        end
        own[i].tokens = 0
      end
    end
  end
end

-- The burst in force caps the bucket: its tokens plus what is lent never
-- exceed it. A bucket above that cap (its burst went down: a plan moved
-- by `map`, a reload), or lending more than the burst, comes down to it
-- here, before anything is taken or lent. The caller's lease, when this
-- call reported it, is counted with the bucket: the bucket first comes
-- down to the burst less what the other leases hold (below zero when
-- they hold more than the burst), then the caller's lease to what that
-- leaves. What the lease loses is dropped, never put back into the
-- bucket: its instance may have admitted from it since the call left,
-- and none may be admitted twice. Another instance's lease is for that
-- instance to report, at its next call, which is capped in turn; until
-- then the bucket counts it against the burst.
for i = 1, n do
  local cap = burst[i] - lentAt(leases[i], now)
  if tokens[i] > cap or cap < 0 then
    local mine = reported[i] and own[i].tokens or 0
    tokens[i] = math.min(tokens[i], cap + mine)
    if mine > 0 then
      own[i].tokens = math.max(0, math.min(mine, math.floor(cap + mine - math.max(0, tokens[i]))))
    end
  end
end

if mode == 'reset' then
  for i = 1, n do
    tokens[i] = burst[i] - lentAt(leases[i], now)
  end
elseif mode == 'refund' then
  for i = 1, n do
    local cap = burst[i] - lentAt(leases[i], now)
    if tokens[i] < cap then
      tokens[i] = math.min(cap, tokens[i] + requested[i])
    end
  end
elseif mode == 'settle' then
  for i = 1, n do
    local diff, maxDebt = requested[i], held[i]
    forgiven[i] = 0
    if diff < 0 then
      local cap = burst[i] - lentAt(leases[i], now)
      if tokens[i] < cap then
        tokens[i] = math.min(cap, tokens[i] - diff)
      end
    else
      local floor = math.min(tokens[i], -maxDebt)
      if tokens[i] - diff < floor then
        forgiven[i] = floor - (tokens[i] - diff)
      end
      tokens[i] = math.max(floor, tokens[i] - diff)
    end
  end
elseif mode == 'take' then
  for i = 1, n do
    if tokens[i] < requested[i] then
      allowed = 0
    end
  end
  if allowed == 1 then
    for i = 1, n do
      tokens[i] = tokens[i] - requested[i]
    end
  end
end

-- Lend: every lease up to the same number of requests.
if fresh and allowed == 1 and (mode == 'take' or mode == 'renew') then
  local reach = math.huge
  for i = 1, n do
    local has = own[i] and own[i].tokens or 0
    local can = math.min(math.max(0, want[i] - has), math.floor(tokens[i] / 2))
    reach = math.min(reach, math.floor((has + math.max(0, can)) / requested[i]))
  end
  for i = 1, n do
    local has = own[i] and own[i].tokens or 0
    local lend = math.max(0, reach * requested[i] - has)
    if lend > 0 or own[i] then
      if not own[i] then
        own[i] = {id = me, tokens = 0}
        leases[i][#leases[i] + 1] = own[i]
      end
      tokens[i] = tokens[i] - lend
      own[i].tokens, own[i].expiry, own[i].seq = own[i].tokens + lend, now + life, seq
    end
  end
end

local reply = {allowed}
for i = 1, n do
  local lent, last, text = 0, now, {}
  for _, l in ipairs(leases[i]) do
    if l.tokens > 0 then
      text[#text + 1] = string.format('%s %d %d %d', l.id, l.tokens, l.expiry, l.seq)
      lent, last = lent + l.tokens, math.max(last, l.expiry)
    end
  end
  -- The bucket lives until it would be full with every lease expired;
  -- what is lent lives as long as its last lease, and the bucket's mark
  -- says so.
  local ttl = math.max(1000, math.ceil((burst[i] - tokens[i]) * 1000 / rate[i]) + math.ceil((last - now) / 1000))
  if #text > 0 then
    redis.call('SET', KEYS[2 * i - 1], string.format('%.17g %d %d %d', tokens[i], now, lent, last), 'PX', ttl)
    redis.call('SET', KEYS[2 * i], table.concat(text, ','), 'PX', math.ceil((last - now) / 1000))
  else
    redis.call('SET', KEYS[2 * i - 1], string.format('%.17g %d', tokens[i], now), 'PX', ttl)
    if recorded[i] then
      redis.call('DEL', KEYS[2 * i])
    end
  end
  local wait = 0
  if mode ~= 'settle' and tokens[i] < requested[i] then
    wait = waitFor(tokens[i], requested[i], rate[i], burst[i], leases[i])
  end
  reply[2 * i] = math.max(0, math.floor(tokens[i]))
  reply[2 * i + 1] = wait
  reply[2 * n + 1 + i] = own[i] and own[i].tokens or 0
  if mode == 'settle' then
    reply[2 * n + 1 + i] = math.floor(forgiven[i])
  end
end
return reply
