-- enqueue.lua: put one-shot tasks at the back of a queue: priority 0 at the
-- back of its list, priority 1..9 at the back of that level of its
-- prioritized set (claimed before the list, the highest level first; see
-- include/prio_add.lua).
--
-- KEYS[1] {ns}:queue:<Q>         LIST of queued payloads
-- KEYS[2] {ns}:queues            SET of known queue names
-- KEYS[3] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[4] {ns}:standby:<Q>       SET of persistent payloads queued or delayed (those not kept as "" in the hash)
-- KEYS[5] {ns}:idle:<Q>          SET of idle servers of Q (see include/wake_idle.lua)
-- KEYS[6] {ns}:prio:<Q>          ZSET of queued tasks with a priority (include/prio_add.lua)
-- ARGV[1] queue name Q
-- ARGV[2] prefix of wake channels ({ns}:wake:), the worker id is appended
-- ARGV[3] priority, 0..9 (0: the plain list)
-- ARGV[4..] payloads, in order
-- Returns: the length of the list afterwards, or with a priority the number
--          of queued tasks with a priority.
-- Errors: CONFLICT (a payload is a persistent task of Q, or a stand-in whose
--         blob is gone: nothing was added), BAD_ARG (priority), OOM (Redis is
--         at maxmemory: nothing was added).
-- Blobs: each stand-in added counts one reference (include/blob.lua).
-- Times: while Q keeps enqueue times, each payload's first enqueue time
--        (include/enqueue_time.lua).
-- Publishes: Q on the wake channels of up to n + 1 idle servers of Q.
--!include include/is_persistent.lua
--!include include/count_arg.lua
--!include include/prio_add.lua
--!include include/wake_idle.lua
--!include include/blob.lua
--!include include/enqueue_time.lua

local level, err = count_arg(ARGV[3], 'priority', 9)
if err then return err end
local n = #ARGV - 3
if n == 0 then return redis.call('LLEN', KEYS[1]) end
if redis.call('EXISTS', KEYS[3], KEYS[4]) > 0 then
  for i = 4, #ARGV do
    if is_persistent(KEYS[3], KEYS[4], ARGV[i]) then
      return redis.error_reply('CONFLICT task ' .. (i - 4) .. ' of this call is a persistent task of queue '
        .. ARGV[1] .. '; a payload is one-shot or persistent in a queue, not both')
    end
  end
end
-- (the blob functions only for a call that may hold a stand-in)
local blobs, prefix, big = nil, nil, blob_maybe(ARGV, 4)
if big then
  blobs = blob_lib()
  prefix = blobs.prefix(KEYS[2])
  local gone
  gone, big = blobs.missing(prefix, ARGV, 4)
  if gone then return blobs.gone(gone - 4) end
end
-- The first write is one that Redis refuses at the memory limit (SADD is
-- "denyoom"; see "At the memory limit" in README.md): refused, nothing is
-- written. Then wake (see wake_idle): refused, it must fail before any task
-- is added, or a retry would add them twice.
redis.call('SADD', KEYS[2], ARGV[1])
wake_idle(KEYS[5], ARGV[2], ARGV[1], n)
enqt_add(KEYS[2], ARGV[1], ARGV, 4, #ARGV)
if big then
  for i = 4, #ARGV do blobs.ref(prefix, ARGV[i]) end
end
if level > 0 then
  local payloads = {}
  for i = 4, #ARGV do payloads[#payloads + 1] = ARGV[i] end
  prio_add(KEYS[6], level, payloads, false)
  return redis.call('ZCARD', KEYS[6])
end
local len = 0
for i = 4, #ARGV, 4000 do
  len = redis.call('RPUSH', KEYS[1], unpack(ARGV, i, math.min(i + 3999, #ARGV)))
end
return len
