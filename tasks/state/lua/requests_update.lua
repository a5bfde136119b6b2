-- Rewrite an idempotent call's record (and set its claim's TTL) only while it is still this call's: a call whose
-- process stalled past its lease before publishing may have had its key taken over by a retry meanwhile.
-- Returns 1 when written, 0 when the record is another call's, -1 when it is gone (expired, or Redis lost it).
--
-- KEYS:
--   1 record           str   the call's record
--   2 idempotency      str   its claim ('' when ARGV[3] is '')
-- ARGV:
--   1 record           JSON  the record to write
--   2 item             text  the call's first item id (what tells it is this call's record)
--   3 ttl_s            s     TTL for both; '' to keep the record's and leave the claim alone
local raw = redis.call('GET', KEYS[1])
if not raw then return -1 end
local ok, r = pcall(cjson.decode, raw)
if not ok or type(r) ~= 'table' or type(r.items) ~= 'table' or r.items[1] ~= ARGV[2] then return 0 end
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
else
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return 1
