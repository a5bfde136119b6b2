-- Fragment of the admission scripts. Defines: forget(set, id).
-- A model's deadline set S (interactive or offline) keeps, for its generation items, their estimated tokens in
-- the hash S:kv and their sum in S:kvsum: what the model's token budget is checked against. forget(S, id) drops
-- an item's tokens wherever the item leaves S.
local function forget(set, id)
  local t = redis.call('HGET', set .. ':kv', id)
  if t then
    redis.call('HDEL', set .. ':kv', id)
    redis.call('DECRBY', set .. ':kvsum', t)
  end
end
