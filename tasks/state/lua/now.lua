-- Fragment: Redis's own clock, read once at the top of a script.
-- Defines: now (seconds since the epoch, with microseconds).
-- Every script that compares scores with the present reads this clock, not a caller's: API hosts whose clocks
-- disagree never purge each other's live entries.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
