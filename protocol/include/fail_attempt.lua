-- include/fail_attempt.lua: fail_attempt; needs:
--!include include/next_attempt.lua

-- next_attempt for one process, with its count read from and written to the
-- hash `attempts`; returns where, delay, and for 'dead' the attempts made.
local function fail_attempt(r, now, attempts, base, cap, first_at_front)
  local prev = tonumber(redis.call('HGET', attempts, r.payload) or '0')
  local a, where, delay, made = next_attempt(r, now, prev, base, cap, first_at_front)
  if a then
    redis.call('HSET', attempts, r.payload, a)
  else
    redis.call('HDEL', attempts, r.payload)
  end
  return where, delay, made
end
