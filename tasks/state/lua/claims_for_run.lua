-- A worker about to run a batch (tasks/state/claims.py, Claims.for_run).
-- KEYS[1] the batch's claim
-- ARGV[1] this run's id (<worker id>/<token>); ARGV[2] the claim's ttl in seconds
-- -> "run" (it was free) | "skip" (done or recovered) | "mine" (this run holds it) | "died:<owner>"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 'run' end
local owner = redis.call('GET', KEYS[1])
if owner == false or string.sub(owner, 1, 1) == '~' then return 'skip' end
if owner == ARGV[1] then return 'mine' end
redis.call('SET', KEYS[1], '~recovered', 'EX', ARGV[2])
return 'died:' .. owner
