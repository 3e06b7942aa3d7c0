-- pause.lua: pause a queue, or resume it. While {ns}:paused:<Q> exists no
-- worker starts a one-shot task of Q (claim.lua, given the key as KEYS[19]);
-- running processes go on and finish, persistent tasks are still claimed and
-- handed over (a pause must not take them down), and delayed tasks that come
-- due still move to the queue, where they wait with the others. A resume
-- wakes Q's idle servers for the tasks queued (the path enqueue takes).
--
-- KEYS[1] {ns}:paused:<Q>   STRING, Redis time (ms) since when Q is paused
-- KEYS[2] {ns}:queues       SET of queue names in use (a pause adds Q)
-- KEYS[3] {ns}:idle:<Q>     SET of idle servers of Q (see include/wake_idle.lua)
-- KEYS[4] {ns}:queue:<Q>    LIST of queued payloads (counted)
-- KEYS[5] {ns}:prio:<Q>     ZSET of queued tasks with a priority (counted)
-- ARGV[1] "pause" or "resume"
-- ARGV[2] queue name Q
-- ARGV[3] prefix of wake channels ({ns}:wake:)
-- Returns: 1 if the call changed something (Q was not paused, or was), 0 if
--          not: running it twice, the second run returns 0 and changes
--          nothing.
-- Errors: BAD_ARG (mode).
-- Publishes: on resume, Q on the wake channels of up to (tasks queued and
--            groups ready, {ns}:gready:<Q>) + 1 idle servers of Q.
--!include include/now_ms.lua
--!include include/int.lua
--!include include/wake_idle.lua

local mode = ARGV[1]
if mode ~= 'pause' and mode ~= 'resume' then
  return redis.error_reply('BAD_ARG mode must be "pause" or "resume"')
end
if mode == 'pause' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
  redis.call('SADD', KEYS[2], ARGV[2])
  redis.call('SET', KEYS[1], int(now_ms()))
  return 1
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
-- (Q's ready groups count too: a queue whose jobs are all in groups woke
-- nobody; their key is made from the namespace's prefix, as include/group.lua
-- makes it)
local gready = string.match(KEYS[4], '^(%b{}:)') .. 'gready:' .. ARGV[2]
local ready = redis.call('LLEN', KEYS[4]) + redis.call('ZCARD', KEYS[5]) + redis.call('ZCARD', gready)
wake_idle(KEYS[3], ARGV[3], ARGV[2], ready)
redis.call('DEL', KEYS[1])
return 1
