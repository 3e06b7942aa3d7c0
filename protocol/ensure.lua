-- ensure.lua: make payloads persistent tasks of a queue, each unique per
-- (queue, payload): a payload that is already a persistent task of Q (queued,
-- delayed or running) is left alone; one that is queued or delayed as a
-- one-shot task of Q is refused, as enqueue.lua refuses the reverse.
--
-- KEYS[1] {ns}:queue:<Q>         LIST of queued payloads
-- KEYS[2] {ns}:queues            SET of known queue names
-- KEYS[3] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see lib.lua to_standby)
-- KEYS[4] {ns}:standby:<Q>       SET of persistent payloads queued or delayed (those not kept as "" in the hash)
-- KEYS[5] {ns}:idle:<Q>          SET of idle servers of Q (see lib.lua wake_idle)
-- KEYS[6] {ns}:delayed:<Q>       ZSET of payloads waiting for a retry
-- KEYS[7] {ns}:unowned:<Q>        ZSET persistent payload -> since when (ms) no process runs it
-- KEYS[8] {ns}:prio:<Q>          ZSET of queued one-shot tasks with a priority (lib.lua prio_add)
-- ARGV[1] queue name Q
-- ARGV[2] prefix of wake channels ({ns}:wake:)
-- ARGV[3..] payloads
-- Returns: per payload 1 if added, 0 if it existed already.
-- Errors: CONFLICT (a payload is queued or delayed as a one-shot task of Q:
--         nothing was added).
-- Cost: the one-shot check reads the queue (LPOS, or one pass for many
--       payloads): O(queue length) when the queue holds tasks, and the
--       tasks with a priority, if any.
-- Publishes: Q on the wake channels of up to (number added) + 1 idle servers.
--!include lib.lua

local out, new, seen = {}, {}, {}
for i = 3, #ARGV do
  local p = ARGV[i]
  if seen[p] or is_persistent(KEYS[3], KEYS[4], p) then
    out[#out + 1] = 0
  else
    seen[p] = i - 3  -- a payload given twice is added once
    new[#new + 1] = p
    out[#out + 1] = 1
  end
end
-- Not persistent, yet in the queue or the delayed set: a one-shot copy.
local function conflict(p)
  return redis.error_reply('CONFLICT task ' .. seen[p] .. ' of this call is a one-shot task of queue '
    .. ARGV[1] .. '; a payload is one-shot or persistent in a queue, not both')
end
for _, p in ipairs(new) do
  if redis.call('ZSCORE', KEYS[6], p) then return conflict(p) end
end
if #new > 0 and redis.call('EXISTS', KEYS[8]) == 1 then
  for _, m in ipairs(redis.call('ZRANGE', KEYS[8], 0, -1)) do
    if seen[string.sub(m, 17)] then return conflict(string.sub(m, 17)) end
  end
end
local len = #new > 0 and redis.call('LLEN', KEYS[1]) or 0
if len > 0 and #new <= 8 then
  for _, p in ipairs(new) do
    if redis.call('LPOS', KEYS[1], p) then return conflict(p) end
  end
elseif len > 0 then
  for i = 0, len - 1, 1000 do
    for _, p in ipairs(redis.call('LRANGE', KEYS[1], i, i + 999)) do
      if seen[p] then return conflict(p) end
    end
  end
end
wake_idle(KEYS[5], ARGV[2], ARGV[1], #new)  -- before the first write, as in enqueue.lua
to_standby(KEYS[3], KEYS[4], new, false, KEYS[7], now_ms())
call_chunked('RPUSH', KEYS[1], new)
redis.call('SADD', KEYS[2], ARGV[1])
return out
