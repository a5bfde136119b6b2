-- Fragment of the requests scripts (needs requests_readable.lua before it). Defines: resolve(raw).
-- The record a request-id key names: its own value, or, for a pointer (a call with an Idempotency-Key: JSON with
-- 'at', the record's key, and 'item', its first item id), the record under its key, while that is still the same
-- call's (nil once it is not: expired, or the key claimed anew).
local function resolve(raw)
  local ok, p = pcall(cjson.decode, raw)
  if not ok or type(p) ~= 'table' or type(p.at) ~= 'string' then return raw end
  local record = redis.call('GET', p.at)
  if not record then return nil end
  local r = readable(record)
  if r and r.items[1] ~= p.item then return nil end
  return record
end
