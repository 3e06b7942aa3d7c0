-- include/fair_share.lua: fair_share; needs nothing.

-- The fair share of a queue, one HMGET: T, the total weight of its
-- persistent tasks (queued, delayed or running), C, the total capacity of
-- the workers that serve it (at least 1), and for `worker` its capacity and
-- the weight of its processes beyond one each (its held weight is SCARD of
-- its held set plus that). W's fair share is T * capacity / C; with every
-- weight and capacity 1, P / S, and every worker should hold floor(P / S)
-- or ceil(P / S).
local function fair_share(share, worker)
  local v = redis.call('HMGET', share, ':weight', ':capacity', 'c' .. worker, 'h' .. worker)
  return tonumber(v[1] or '0'), math.max(1, tonumber(v[2] or '0')),
    tonumber(v[3] or '1'), tonumber(v[4] or '0')
end
