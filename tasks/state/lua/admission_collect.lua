-- Read calls' results, releasing the admission of every item that has one (needs admission_forget.lua before it).
-- Built in Python by tasks.state.admission_scripts (CollectKeys, CollectArgs, collect_round): change both together.
--
-- The script does it for several calls in one round trip (the callers an API process woke together).
--   KEYS: every call's keys, the calls in order (below: one call's).
--   ARGV[1]: the number of calls; then per call: the count of its keys, the count of its arguments, and its
--   arguments (below).
-- Returns, per call in order, the values of its result keys (nil where none yet), with 'finished' appended when
-- its record was written finished.
-- With a record: when every result is there and none is an error, the record is written finished, to expire with
-- the first of its results.
--
-- One call's KEYS:
--   1 inflight         zset  every admitted item, by deadline
--   2 arrivals         zset  every admitted item, by arrival
--   3 offline          zset  every offline item, by deadline
--   4 tenant           zset  the tenant's admitted items, by deadline
--   5 deadline         zset  the model's deadline set of the call's class (interactive or :offline; + :kv, :kvsum)
--   6 model_arrivals   zset  the model's interactive items, by arrival
--   7 owner            hash  the API process's admissions (item id -> tenant, model, class)
--   8 record           str   the call's record ('' for none)
--   9 ..               str   the items' result keys (JSON results), in item order
-- One call's ARGV:
--   1 finished         JSON  the record as finished with 200 ('' for none)
--   2 ..               the item ids of the result keys, in the same order
local function collect(KEYS, ARGV)  -- one call's keys and arguments (shadowing the script's)
local values = redis.call('MGET', unpack(KEYS, 9))
local all = true
for i = 1, #values do
  if values[i] then
    for k = 1, 6 do redis.call('ZREM', KEYS[k], ARGV[i + 1]) end
    redis.call('HDEL', KEYS[7], ARGV[i + 1])
    forget(KEYS[5], ARGV[i + 1])
  else
    all = false
  end
end
if KEYS[8] ~= '' and all then
  local ttl = nil
  for i = 1, #values do
    if cjson.decode(values[i]).error then return values end
    local left = redis.call('TTL', KEYS[8 + i])
    if ttl == nil or left < ttl then ttl = left end
  end
  if ttl and ttl > 0 then
    redis.call('SET', KEYS[8], ARGV[1], 'EX', ttl)
    values[#values + 1] = 'finished'
  end
end
return values
end

local out, k, a = {}, 0, 2
for c = 1, tonumber(ARGV[1]) do
  local nk, na = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  out[c] = collect({unpack(KEYS, k + 1, k + nk)}, {unpack(ARGV, a + 2, a + 1 + na)})
  k, a = k + nk, a + 2 + na
end
return out
