-- Claim an Idempotency-Key for a call, writing the claim and the call's record together, or return what the key
-- names (needs now.lua, requests_readable.lua, requests_view.lua, requests_resolve.lua before it).
-- Built in Python by tasks.state.requests (ClaimKeys, ClaimArgs): change both together.
--
-- KEYS:
--   1 idempotency      str   the claim: JSON {body, request_id, item, record}
--   2 record           str   the record the claim will name ('' for a peek)
--   3 leases           zset  the API processes' leases, by expiry (Redis time, s)
--   4 request          str   the call's request-id key, to hold a pointer to the record ('' for a peek)
-- ARGV:
--   1 claim            JSON  the claim to write (body hash, request id, first item id, record key; '' for a peek)
--   2 record           JSON  this call's record ('' for a peek)
--   3 ttl_s            s     TTL of the claim, the record and the pointer (0 for a peek)
--   4 request_prefix   text  prefix of the tenant's request-id keys (+ request id)
--   5 result_prefix    text  prefix of result keys (+ item id)
--   6 mode             'peek' to only look; '' to claim a free key
--   7 pointer          JSON  the pointer to the record, for the request-id key: {at, item} ('' for a peek)
-- Returns {'claimed'} ({'free'} for a peek); {'held', claim, record, items with a result (-1: the record cannot be
-- read), 1 if its API process is alive, Redis time}; or {'unreadable', claim} when the claim cannot be read. A key
-- whose record is gone (expired, or released), or whose call was never published and whose process is dead, is
-- free again. A claim written before records lived under their key names its record by request id.
local held = redis.call('GET', KEYS[1])
if held then
  local ok, claim = pcall(cjson.decode, held)
  if not ok or type(claim) ~= 'table' or type(claim.item) ~= 'string' then return {'unreadable', held} end
  local record
  local own = type(claim.record) == 'string'
  if own then
    record = redis.call('GET', claim.record)
  else
    record = redis.call('GET', ARGV[4] .. tostring(claim.request_id))
    if record then record = resolve(record) end
  end
  if record then
    local r = readable(record)
    -- under its key, a record is written with its claim and rewritten only while it is its claim's call: another
    -- call's there is damage, as an unreadable one is (by request id it is a later call's: the key is free)
    if not r or (own and r.items[1] ~= claim.item) then return {'held', held, record, -1, 0, tostring(now)} end
    if r.items[1] == claim.item then
      local found = view(record, ARGV[5], KEYS[3])
      -- a call whose process died before it was being sent will never run: its key is free again (not one with
      -- a result: a record from a version that marked it only after the confirm)
      local never = r.published == false and found[2] == 0 and found[3] == 0
      if not never then return {'held', held, found[1], found[2], found[3], found[4]} end
    end
  end
end
if ARGV[6] == 'peek' then return {'free'} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
redis.call('SET', KEYS[4], ARGV[7], 'EX', ARGV[3])
return {'claimed'}
