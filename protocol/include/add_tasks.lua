-- include/add_tasks.lua: add_tasks; needs:
--!include include/add_share.lua

-- New persistent tasks of Q, `n` of them of weight `weight` each.
local function add_tasks(share, n, weight)
  add_share(share, ':weight', n * weight)
  if weight ~= 1 then add_share(share, ':heavy', n) end
end
