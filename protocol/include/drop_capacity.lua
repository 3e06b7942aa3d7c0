-- include/drop_capacity.lua: drop_capacity; needs:
--!include include/set_capacity.lua

-- W no longer serves Q: its capacity leaves the sum.
local function drop_capacity(share, worker)
  set_capacity(share, worker, 0, tonumber(redis.call('HGET', share, 'c' .. worker) or '1'))
end
