-- include/prio_remove.lua: prio_remove; needs nothing.

-- Remove every copy of `payload` from a {ns}:prio:<Q> set (see prio_add);
-- returns how many. O(prioritized tasks queued).
local function prio_remove(prio, payload)
  local n = 0
  for _, m in ipairs(redis.call('ZRANGE', prio, 0, -1)) do
    if string.sub(m, 17) == payload then n = n + redis.call('ZREM', prio, m) end
  end
  return n
end
