-- include/is_persistent.lua: is_persistent; needs nothing.

-- Whether `payload` is a persistent task of a queue: queued or delayed (a
-- member of its standby set, or a field of its persistent hash with the
-- value "": see to_standby) or running (a field of the hash, with the id of
-- the process that runs it).
local function is_persistent(running, standby, payload)
  return redis.call('SISMEMBER', standby, payload) == 1
    or redis.call('HEXISTS', running, payload) == 1
end
