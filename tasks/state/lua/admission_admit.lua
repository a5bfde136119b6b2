-- Admit calls' items under every cap, all of a call's items or none (needs now.lua, admission_purge.lua before it).
-- Built in Python by tasks.state.admission_scripts (AdmitKeys, AdmitArgs, admit_round): change both together.
--
-- The script admits several calls in one round trip (the calls an API process has ready at once, see
-- tasks.gateway.rounds), one after the other: a call admitted counts against the caps of those after it.
--   KEYS: 12 per call, the calls in order (below: one call's, 1 to 12).
--   ARGV[1]: the number of calls; then per call: the count of its arguments, and its arguments (below).
-- Returns one verdict per call, in order:
--   'ok:<n>' with n the items counted at the call's model once it is in (what the next call would find ahead
--   of it: the API process's view of the line, tasks.policy.room); 'quarantined:<hash>' (one of its inputs is
--   quarantined); 'tenant_full:<n>' / 'full:<n>' with n the items ahead in the set that was full;
--   'tokens_full:<n>' with the tokens the model holds; or 'late' when the call reached Redis after its caller
--   stopped waiting for the answer (a link that came back: admitting it then would hold capacity for a call
--   that was already refused).
-- An interactive call counts only the interactive items ahead of it (they go first in every batch); an offline
-- call counts both classes at its model, and only offline items against the global caps.
--
-- One call's KEYS:
--    1 inflight         zset  every admitted item, by deadline (Redis time, s)
--    2 arrivals         zset  every admitted item, by arrival (Redis time, s)
--    3 quarantine       set   quarantined input hashes
--    4 tenant           zset  the tenant's admitted items, by deadline
--    5 model            zset  the model's interactive items, by deadline (+ :kv, :kvsum: their tokens)
--    6 model_arrivals   zset  the model's interactive items, by arrival
--    7 model_rate       int   the model's arrivals in this second (the API host's clock), expires in 60 s
--    8 model_offline    zset  the model's offline items, by deadline (+ :kv, :kvsum: their tokens)
--    9 offline          zset  every offline item, by deadline
--   10 owner            hash  this API process's admissions: item id -> tenant, model, class (tab-separated)
--   11 leases           zset  the API processes' leases, by expiry (Redis time, s)
--   12 record           str   the call's record, written with the admission ('' for none)
-- One call's ARGV:
--    1 interactive_cap  items   global cap of interactive items
--    2 model_cap        items   the model's cap (what it can answer within the caller's deadline)
--    3 tenant_cap       items   the tenant's in-flight cap
--    4 timeout_s        s       each item's deadline is Redis's now plus this
--    5 n                items   how many items the call has
--    6 priority         'interactive' | 'offline'
--    7 offline_cap      items   global cap of offline items
--    8 owner_entry      text    tenant, model, class, tab-separated: the value in KEYS[10]
--    9 instance         text    this API process's id (its member in KEYS[11])
--   10 lease_s          s       this process's lease, renewed with the admission
--   11 valid_until      Redis time (s, epoch): later than this the call is 'late'
--   12 token_cap        tokens  the model's token budget (0: none)
--   13 record_value     JSON    the call's record ('' for none)
--   14 record_ttl_s     s       its TTL
--   15 .. 14+n          the item ids
--   15+n .. 14+2n       their input hashes
--   15+2n .. 14+3n      their estimated tokens (prompt + max_tokens; 0 for an item that is not generation)
local function admit(KEYS, ARGV)  -- one call's keys and arguments (shadowing the script's)
if now > tonumber(ARGV[11]) then return 'late' end
local n = tonumber(ARGV[5])
local first = 15
for i = first + n, #ARGV do
  if redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 1 then return 'quarantined:' .. ARGV[i] end
end
purge(KEYS[1], KEYS[2])
purge(KEYS[4], '')
purge(KEYS[5], KEYS[6])
purge(KEYS[8], '')
purge(KEYS[9], '')
local tenant_ahead = redis.call('ZCARD', KEYS[4])
if tenant_ahead + n > tonumber(ARGV[3]) then return 'tenant_full:' .. tenant_ahead end
redis.call('INCRBY', KEYS[7], n)  -- demand within tenant caps, admitted or not: what autoscaling must cover
redis.call('EXPIRE', KEYS[7], 60)
local offline = ARGV[6] == 'offline'
local ahead = redis.call('ZCARD', KEYS[5])
if offline then ahead = ahead + redis.call('ZCARD', KEYS[8]) end
if ahead + n > tonumber(ARGV[2]) then return 'full:' .. ahead end
local offline_total = redis.call('ZCARD', KEYS[9])
if offline then
  if offline_total + n > tonumber(ARGV[7]) then return 'full:' .. offline_total end
else
  local interactive_total = redis.call('ZCARD', KEYS[1]) - offline_total
  if interactive_total + n > tonumber(ARGV[1]) then return 'full:' .. interactive_total end
end
local need = 0
for i = first + 2 * n, first + 3 * n - 1 do need = need + tonumber(ARGV[i]) end
local token_cap = tonumber(ARGV[12])
if token_cap > 0 and need > 0 then
  local held = tonumber(redis.call('GET', KEYS[5] .. ':kvsum') or '0')
    + tonumber(redis.call('GET', KEYS[8] .. ':kvsum') or '0')
  if held + need > token_cap then return 'tokens_full:' .. held end
end
local deadline = now + tonumber(ARGV[4])
local kv_set = offline and KEYS[8] or KEYS[5]
if need > 0 then redis.call('INCRBY', kv_set .. ':kvsum', need) end
redis.call('ZADD', KEYS[11], now + tonumber(ARGV[10]), ARGV[9])
for i = first, first + n - 1 do
  redis.call('ZADD', KEYS[1], deadline, ARGV[i])
  redis.call('ZADD', KEYS[2], now, ARGV[i])
  redis.call('ZADD', KEYS[4], deadline, ARGV[i])
  redis.call('HSET', KEYS[10], ARGV[i], ARGV[8])
  if ARGV[i + 2 * n] ~= '0' then redis.call('HSET', kv_set .. ':kv', ARGV[i], ARGV[i + 2 * n]) end
  if offline then
    redis.call('ZADD', KEYS[8], deadline, ARGV[i])
    redis.call('ZADD', KEYS[9], deadline, ARGV[i])
  else
    redis.call('ZADD', KEYS[5], deadline, ARGV[i])
    redis.call('ZADD', KEYS[6], now, ARGV[i])
  end
end
if KEYS[12] ~= '' then redis.call('SET', KEYS[12], ARGV[13], 'EX', ARGV[14]) end
return 'ok:' .. (ahead + n)
end

local verdicts, k, a = {}, 0, 2
for c = 1, tonumber(ARGV[1]) do
  local count = tonumber(ARGV[a])
  verdicts[c] = admit({unpack(KEYS, k + 1, k + 12)}, {unpack(ARGV, a + 1, a + count)})
  k, a = k + 12, a + count + 1
end
return verdicts
