-- The view of the record a request-id key names, or nil (needs now.lua, requests_readable.lua, requests_view.lua,
-- requests_resolve.lua before it). Returns view()'s list (requests_view.lua).
--
-- KEYS:
--   1 request          str   a request-id key: a record, or a pointer to one
--   2 leases           zset  the API processes' leases, by expiry (Redis time, s)
-- ARGV:
--   1 result_prefix    text  prefix of result keys (+ item id)
local raw = redis.call('GET', KEYS[1])
if not raw then return nil end
local record = resolve(raw)
if not record then return nil end
return view(record, ARGV[1], KEYS[2])
