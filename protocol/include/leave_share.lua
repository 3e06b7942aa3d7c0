-- include/leave_share.lua: leave_share; needs:
--!include include/drop_capacity.lua

-- W leaves Q with every process it held there: its held weight is
-- forgotten, and, if it was a server (`server`), its capacity leaves the sum.
local function leave_share(share, worker, server)
  if server then drop_capacity(share, worker) end
  redis.call('HDEL', share, 'h' .. worker)
end
