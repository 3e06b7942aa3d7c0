-- include/delay_level.lua: delay_level; needs nothing.

-- A payload entering a delayed set with a priority: its level is kept in
-- {ns}:delayed_prio:<Q> (payload -> level; the higher one when a delayed
-- payload is delayed again, as the two share one entry) until it is due.
local function delay_level(dprio, payload, level)
  if level > 0 then
    local cur = tonumber(redis.call('HGET', dprio, payload) or '0')
    if level > cur then redis.call('HSET', dprio, payload, level) end
  end
end
