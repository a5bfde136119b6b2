-- Renew an API process's lease, and release everything admitted by processes whose lease lapsed (needs now.lua,
-- admission_forget.lua before it). Built in Python by tasks.state.admission_scripts (RenewArgs).
-- Returns how many items it released.
--
-- KEYS:
--   1 leases           zset  the API processes' leases: instance id, by expiry (Redis time, s)
-- ARGV:
--   1 instance         text  this process's id ('' for a reaper holding no lease: nothing is renewed)
--   2 lease_s          s     how long the renewed lease lasts
--   3 prefix           text  the key prefix of the admission sets (<prefix>, <prefix>:arrivals, <prefix>:offline,
--                            <prefix>:t:<tenant>, <prefix>:m:<model>[:offline|:arrivals], <prefix>:owner:<instance>)
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) end
local prefix = ARGV[3]
local released = 0
for _, instance in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  local owner = prefix .. ':owner:' .. instance
  local entries = redis.call('HGETALL', owner)
  for i = 1, #entries, 2 do
    local id, entry = entries[i], entries[i + 1]
    local tenant, model, class = string.match(entry, '^(.-)\t(.-)\t(.-)$')
    local m = prefix .. ':m:' .. model
    redis.call('ZREM', prefix, id)
    redis.call('ZREM', prefix .. ':arrivals', id)
    redis.call('ZREM', prefix .. ':offline', id)
    redis.call('ZREM', prefix .. ':t:' .. tenant, id)
    redis.call('ZREM', m, id)
    redis.call('ZREM', m .. ':offline', id)
    redis.call('ZREM', m .. ':arrivals', id)
    forget(class == 'offline' and m .. ':offline' or m, id)
    released = released + 1
  end
  redis.call('DEL', owner)
  redis.call('ZREM', KEYS[1], instance)
end
return released
