-- include/now_ms_us.lua: now_ms_us; needs nothing.

-- Both from one TIME call (each call costs about as much as a small command).
local function now_ms_us()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us
end
