-- include/set_weight.lua: set_weight; needs:
--!include include/add_share.lua

-- Set the weight of a persistent task of Q (it was `was`): its entry and
-- the sums. Returns the change.
local function set_weight(share, payload, weight, was)
  if weight == was then return 0 end
  if weight == 1 then
    redis.call('HDEL', share, 'w' .. payload)
  else
    redis.call('HSET', share, 'w' .. payload, weight)
  end
  add_share(share, ':weight', weight - was)
  add_share(share, ':heavy', (weight ~= 1 and 1 or 0) - (was ~= 1 and 1 or 0))
  return weight - was
end
