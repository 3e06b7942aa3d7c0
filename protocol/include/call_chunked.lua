-- include/call_chunked.lua: call_chunked; needs nothing.

-- redis.call(cmd, key, <head...>, items...) in chunks (Lua's unpack() has a
-- limit on the number of values); does nothing when `items` is empty.
local function call_chunked(cmd, key, items, step)
  step = step or 1
  local chunk = 1000 * step
  for i = 1, #items, chunk do
    redis.call(cmd, key, unpack(items, i, math.min(i + chunk - 1, #items)))
  end
end
