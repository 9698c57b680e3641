-- The live slots of one concurrent limit's set (KEYS[1]): the
-- microseconds until each expires, by Redis time, soonest first. It
-- writes nothing (the admin API's read).
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local scores = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES')
local left = {}
for i = 2, #scores, 2 do
  left[#left + 1] = tonumber(scores[i]) - now
end
return left
