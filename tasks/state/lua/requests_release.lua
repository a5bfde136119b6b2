-- Forget a call refused before it ran: its claim, its record and what its request id names, each only while it
-- still names this call (a retry may have claimed the key, a later call reused the id; a claim written by an
-- earlier version names it the same way, by its first item). Returns 1.
--
-- KEYS:
--   1 idempotency      str   the call's claim ('' for none)
--   2 record           str   the call's record
--   3 request          str   its request-id key (KEYS[2] again for a call without a key)
-- ARGV:
--   1 item             text  the call's first item id
local function mine(key)
  if key == '' then return false end
  local raw = redis.call('GET', key)
  if not raw then return false end
  local ok, r = pcall(cjson.decode, raw)
  if not ok or type(r) ~= 'table' then return false end
  return (type(r.items) == 'table' and r.items[1] == ARGV[1]) or r.item == ARGV[1]
end
for i = 1, 3 do
  if mine(KEYS[i]) then redis.call('DEL', KEYS[i]) end
end
return 1
