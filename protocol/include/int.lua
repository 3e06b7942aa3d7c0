-- include/int.lua: int; needs nothing.

-- Integers as plain decimal strings (tostring() turns 1e15 into "1e+15").
local function int(n)
  return string.format('%.0f', n)
end
