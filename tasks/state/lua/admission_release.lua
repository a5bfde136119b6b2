-- Release items, whatever their state (needs admission_forget.lua before it).
-- Built in Python by tasks.state.admission_scripts (ReleaseKeys): change both together.
-- Returns how many item ids it was given.
--
-- KEYS (one call's):
--   1 inflight         zset  every admitted item, by deadline
--   2 arrivals         zset  every admitted item, by arrival
--   3 offline          zset  every offline item, by deadline
--   4 tenant           zset  the tenant's admitted items, by deadline
--   5 deadline         zset  the model's deadline set of the call's class (interactive or :offline; + :kv, :kvsum)
--   6 model_arrivals   zset  the model's interactive items, by arrival
--   7 owner            hash  the API process's admissions (item id -> tenant, model, class)
-- ARGV:
--   1 ..               the item ids
for i = 1, #ARGV do
  for k = 1, 6 do redis.call('ZREM', KEYS[k], ARGV[i]) end
  redis.call('HDEL', KEYS[7], ARGV[i])
  forget(KEYS[5], ARGV[i])
end
return #ARGV
