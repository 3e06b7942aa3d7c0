-- delay.lua: put one-shot tasks in a queue's delayed set, due at a time of
-- the Redis clock (after a delay, or at an absolute time). A claim moves due
-- ones to the head of the queue, as it does with retries.
--
-- A payload waits in the delayed set at most once per queue: delaying one
-- that is already delayed (a retry, or an earlier delay) keeps one entry, due
-- at the earlier of the two times, and does not count it as added.
--
-- KEYS[1] {ns}:delayed:<Q>       ZSET payload -> due time (ms)
-- KEYS[2] {ns}:queues            SET of known queue names
-- KEYS[3] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[4] {ns}:standby:<Q>       SET of persistent payloads queued or delayed (those not kept as "" in the hash)
-- KEYS[5] {ns}:idle:<Q>          SET of idle servers of Q (see include/wake_idle.lua)
-- KEYS[6] {ns}:delayed_prio:<Q>  HASH payload -> priority (1..9) of a delayed task: when due it
--                                goes to the front of its level (claim.lua, include/prio_add.lua)
-- ARGV[1] queue name Q
-- ARGV[2] prefix of wake channels ({ns}:wake:), the worker id is appended
-- ARGV[3] mode: "in" (ARGV[4] ms from now) or "at" (ARGV[4] = the due time,
--         ms since the Unix epoch on the Redis clock; a time past is due now)
-- ARGV[4] a whole number of ms >= 0
-- ARGV[5] priority, 0..9 (a payload delayed twice keeps the higher)
-- ARGV[6..] payloads
-- Returns: {payloads newly delayed, the due time in ms (Redis clock), now_ms}.
-- Blobs: each stand-in newly delayed counts one reference (include/blob.lua).
-- Errors: CONFLICT (a payload is a persistent task of Q, or a stand-in whose
--         blob is gone: nothing changed),
--         BAD_ARG (mode, time, priority), OOM (Redis is at maxmemory:
--         nothing changed).
-- Times: while Q keeps enqueue times, each payload's first enqueue time
--        (include/enqueue_time.lua).
-- Publishes: when the new due time is the queue's earliest, Q on the wake
--            channels of up to two idle servers of Q: they claim, and the
--            claim's reply tells them when the first delayed task is due.
--!include include/now_ms.lua
--!include include/int.lua
--!include include/is_persistent.lua
--!include include/count_arg.lua
--!include include/delay_level.lua
--!include include/wake_idle.lua
--!include include/blob.lua
--!include include/enqueue_time.lua
local blobs = blob_lib()

local mode = ARGV[3]
if mode ~= 'in' and mode ~= 'at' then
  return redis.error_reply('BAD_ARG mode must be "in" or "at"')
end
local ms, err = count_arg(ARGV[4], 'delay')
if err then return err end
local level
level, err = count_arg(ARGV[5], 'priority', 9)
if err then return err end
local now = now_ms()
local due = ms
if mode == 'in' then due = now + ms end
local n = #ARGV - 5
if n == 0 then return {0, due, now} end
if redis.call('EXISTS', KEYS[3], KEYS[4]) > 0 then
  for i = 6, #ARGV do
    if is_persistent(KEYS[3], KEYS[4], ARGV[i]) then
      return redis.error_reply('CONFLICT task ' .. (i - 6) .. ' of this call is a persistent task of queue '
        .. ARGV[1] .. '; a payload is one-shot or persistent in a queue, not both')
    end
  end
end
local prefix = blobs.prefix(KEYS[2])
local gone, big = blobs.missing(prefix, ARGV, 6)
if gone then return blobs.gone(gone - 6) end
local refs = {}  -- the stand-ins not delayed yet (one entry per payload)
if big then
  for i = 6, #ARGV do
    local p = ARGV[i]
    if blobs.is(p) and not refs[p] and not redis.call('ZSCORE', KEYS[1], p) then
      refs[#refs + 1] = p
      refs[p] = true
    end
  end
end
-- the first write, refused at the memory limit (as in enqueue.lua)
redis.call('SADD', KEYS[2], ARGV[1])
for _, p in ipairs(refs) do blobs.ref(prefix, p) end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #first == 0 or tonumber(first[2]) > due then
  -- before any task is written (see wake_idle); one task, one spare
  wake_idle(KEYS[5], ARGV[2], ARGV[1], 1)
end
enqt_add(KEYS[2], ARGV[1], ARGV, 6, #ARGV, now)
local added = 0
for i = 6, #ARGV, 2000 do
  local args = {}
  for j = i, math.min(i + 1999, #ARGV) do
    args[#args + 1] = int(due)
    args[#args + 1] = ARGV[j]
  end
  added = added + redis.call('ZADD', KEYS[1], 'LT', unpack(args))
end
if level > 0 then
  for i = 6, #ARGV do delay_level(KEYS[6], ARGV[i], level) end
end
return {added, due, now}
