-- include/expire_reserved.lua: expire_reserved; needs:
--!include include/is_queued_persistent.lua

-- Put the reservations of {ns}:reserved:<Q> that ran out (their worker did
-- not claim in time: it died, or left) back at the head of the queue, and
-- drop those of tasks that are no longer persistent (cancelled). Returns
-- how many went back, and the payloads reserved for `worker` still valid.
local function expire_reserved(reserved, queue, persistent, standby, now, worker)
  local back, mine = 0, {}
  local all = redis.call('HGETALL', reserved)
  for i = 1, #all, 2 do
    local payload = all[i]
    local w, at = string.match(all[i + 1], '^(.*):(%d+)$')  -- parse_entry, inlined
    at = tonumber(at or '0')
    if not is_queued_persistent(persistent, standby, payload) then
      redis.call('HDEL', reserved, payload)
    elseif at <= now then
      redis.call('HDEL', reserved, payload)
      redis.call('LPUSH', queue, payload)
      back = back + 1
    elseif w == worker then
      mine[#mine + 1] = payload
    end
  end
  return back, mine
end
