-- ensure.lua: make payloads persistent tasks of a queue, each unique per
-- (queue, payload): a payload that is already a persistent task of Q (queued,
-- delayed or running) is left alone.
--
-- KEYS[1] {ns}:queue:<Q>         LIST of queued payloads
-- KEYS[2] {ns}:queues            SET of known queue names
-- KEYS[3] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see lib.lua to_standby)
-- KEYS[4] {ns}:standby:<Q>       SET of persistent payloads queued or delayed (those not kept as "" in the hash)
-- KEYS[5] {ns}:idle:<Q>          SET of idle servers of Q (see lib.lua wake_idle)
-- ARGV[1] queue name Q
-- ARGV[2] prefix of wake channels ({ns}:wake:)
-- ARGV[3..] payloads
-- Returns: per payload 1 if added, 0 if it existed already.
-- Errors: none.
-- Publishes: Q on the wake channels of up to (number added) + 1 idle servers.
--!include lib.lua

local out, new, seen = {}, {}, {}
for i = 3, #ARGV do
  local p = ARGV[i]
  if seen[p] or is_persistent(KEYS[3], KEYS[4], p) then
    out[#out + 1] = 0
  else
    seen[p] = true  -- a payload given twice is added once
    new[#new + 1] = p
    out[#out + 1] = 1
  end
end
wake_idle(KEYS[5], ARGV[2], ARGV[1], #new)  -- before the first write, as in enqueue.lua
to_standby(KEYS[3], KEYS[4], new, false)
call_chunked('RPUSH', KEYS[1], new)
redis.call('SADD', KEYS[2], ARGV[1])
return out
