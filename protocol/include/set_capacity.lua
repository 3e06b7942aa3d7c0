-- include/set_capacity.lua: set_capacity; needs:
--!include include/add_share.lua

-- W becomes a server of Q with capacity `cap` (`was`: its capacity as a
-- server already, or 0 if it was not one).
local function set_capacity(share, worker, cap, was)
  if cap == was then return end
  if cap == 1 or cap == 0 then
    redis.call('HDEL', share, 'c' .. worker)
  else
    redis.call('HSET', share, 'c' .. worker, cap)
  end
  add_share(share, ':capacity', cap - was)
end
