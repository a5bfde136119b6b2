-- The arrival time of a model's oldest unanswered interactive item, after purging the expired ones (needs now.lua,
-- admission_purge.lua before it). Called by tasks.state.model_load (OldestKeys in tasks.state.admission_scripts).
-- Returns that arrival (Redis time, s, as a string), or false when the model has none.
--
-- KEYS:
--   1 model            zset  the model's interactive items, by deadline (Redis time, s)
--   2 model_arrivals   zset  the same items, by arrival (Redis time, s)
-- ARGV: none.
purge(KEYS[1], KEYS[2])
local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #oldest == 0 then return false end
return oldest[2]
