-- A batcher taking back a lost worker's batch (tasks/state/claims.py, Claims.for_recovery).
-- KEYS[1] the batch's claim
-- ARGV[1] the claim's ttl in seconds; ARGV[2] the recovery message's id (so a redelivery resumes its verdict)
-- -> "stranded" (it never started) | "died:<owner>" (it was running) | "skip" (dealt with already)
if redis.call('SET', KEYS[1], '~s:' .. ARGV[2], 'NX', 'EX', ARGV[1]) then return 'stranded' end
local owner = redis.call('GET', KEYS[1])
if owner == '~s:' .. ARGV[2] then return 'stranded' end
local mark = '~d:' .. ARGV[2] .. '|'
if string.sub(owner, 1, #mark) == mark then return 'died:' .. string.sub(owner, #mark + 1) end
if owner == false or string.sub(owner, 1, 1) == '~' then return 'skip' end
redis.call('SET', KEYS[1], mark .. owner, 'EX', ARGV[1])
return 'died:' .. owner
