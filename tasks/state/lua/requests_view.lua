-- Fragment of the requests scripts (needs now.lua, requests_readable.lua before it).
-- Defines: view(record, results, leases).
-- The state of one record (its JSON) at this instant: {record, items with a result (-1: the record cannot be
-- read), 1 if the API process running it holds a live lease else 0, Redis time (s, as a string)}.
-- results: the prefix of result keys (+ item id); leases: the zset of API processes' leases, by expiry.
local function view(record, results, leases)
  local r = readable(record)
  if not r then return {record, -1, 0, tostring(now)} end
  local present = 0
  for _, id in ipairs(r.items) do present = present + redis.call('EXISTS', results .. id) end
  local lease = redis.call('ZSCORE', leases, r.instance)
  local alive = 0
  if lease and tonumber(lease) > now then alive = 1 end
  return {record, present, alive, tostring(now)}
end
