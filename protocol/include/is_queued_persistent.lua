-- include/is_queued_persistent.lua: is_queued_persistent; needs nothing.

-- Whether a payload popped from a queue is a persistent task (see
-- to_standby).
local function is_queued_persistent(persistent, standby, payload)
  local v = redis.call('HGET', persistent, payload)
  if v then return v == '' end
  return redis.call('SISMEMBER', standby, payload) == 1
end
