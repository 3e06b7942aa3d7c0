-- include/task_weight.lua: task_weight; needs nothing.

-- The weight of a persistent task of Q.
local function task_weight(share, payload)
  return tonumber(redis.call('HGET', share, 'w' .. payload) or '1')
end
