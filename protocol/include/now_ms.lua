-- include/now_ms.lua: now_ms; needs nothing.

-- Whole milliseconds from the Redis clock (the only clock that judges).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
