-- Fragment of the admission scripts (needs now.lua before it). Defines: purge(by_deadline, by_arrival).
-- Forgets the members of a deadline set whose deadline (their score, Redis time) has passed, their tokens
-- (by_deadline:kv, by_deadline:kvsum) and their entries in its arrival set (by_arrival; '' for none).
local function purge(by_deadline, by_arrival)
  local expired = redis.call('ZRANGEBYSCORE', by_deadline, '-inf', now)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', by_deadline, '-inf', now)
    for i = 1, #expired, 1000 do
      local chunk = {unpack(expired, i, math.min(i + 999, #expired))}
      if by_arrival ~= '' then redis.call('ZREM', by_arrival, unpack(chunk)) end
      local held, gone = redis.call('HMGET', by_deadline .. ':kv', unpack(chunk)), 0
      for j = 1, #chunk do if held[j] then gone = gone + tonumber(held[j]) end end
      if gone > 0 then
        redis.call('HDEL', by_deadline .. ':kv', unpack(chunk))
        redis.call('DECRBY', by_deadline .. ':kvsum', gone)
      end
    end
  end
end
