-- Fragment of the requests scripts. Defines: readable(raw).
-- A record's JSON decoded, or nil when it lacks what the scripts read (not JSON, no non-empty list of item ids, or
-- no instance): the caller is told it cannot be read, rather than the script failing as if Redis were away.
local function readable(raw)
  local ok, r = pcall(cjson.decode, raw)
  if not ok or type(r) ~= 'table' or type(r.items) ~= 'table' or type(r.instance) ~= 'string' then return nil end
  if type(r.items[1]) ~= 'string' then return nil end  -- no list of item ids (an object, or an empty list)
  for _, id in ipairs(r.items) do if type(id) ~= 'string' then return nil end end
  return r
end
