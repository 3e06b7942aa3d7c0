-- include/forget_weight.lua: forget_weight; needs:
--!include include/task_weight.lua
--!include include/add_share.lua
--!include include/set_weight.lua

-- The persistent task `payload` leaves Q (finished or cancelled): its
-- weight leaves the sums. Returns its weight.
local function forget_weight(share, payload)
  local w = task_weight(share, payload)
  set_weight(share, payload, 1, w)
  add_share(share, ':weight', -1)
  return w
end
