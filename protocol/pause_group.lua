-- pause_group.lua: pause a group of a queue, or resume it (see "Groups" in
-- README.md and include/group.lua). While G is paused no worker starts a
-- job of G; its running jobs go on and finish, its delayed jobs still come
-- due into it, and enqueues still add to it. A resume makes it ready again
-- and wakes Q's idle servers.
--
-- KEYS[1] {ns}:idle:<Q>     SET of idle servers of Q (see include/wake_idle.lua);
--                           the group keys are made from its prefix
-- ARGV[1] "pause" or "resume"
-- ARGV[2] queue name Q
-- ARGV[3] prefix of wake channels ({ns}:wake:)
-- ARGV[4] group name G
-- Returns: 1 if the call changed something (G was not paused, or was), 0 if
--          not: running it twice, the second run returns 0.
-- Errors: BAD_ARG (mode, group name).
-- Publishes: on resume, Q on the wake channels of up to (jobs queued in G,
--            at most 100) + 1 idle servers of Q.
--!include include/now_ms.lua
--!include include/int.lua
--!include include/group.lua
local groups = group_lib()

local mode, q, g = ARGV[1], ARGV[2], ARGV[4]
if mode ~= 'pause' and mode ~= 'resume' then
  return redis.error_reply('BAD_ARG mode must be "pause" or "resume"')
end
if not string.match(g, '^[A-Za-z0-9_.:/@+=-]+$') or #g > 200 then
  return redis.error_reply('BAD_ARG group name must be 1 to 200 of A-Z a-z 0-9 _ . : / @ + = -')
end
local G = groups.keys(string.match(KEYS[1], '^(%b{}:)'), q)
if mode == 'pause' then
  if redis.call('HEXISTS', G.hash, 'p:' .. g) == 1 then return 0 end
  redis.call('HSET', G.hash, 'p:' .. g, int(now_ms()))
  redis.call('ZREM', G.ready, g)
  return 1
end
if redis.call('HDEL', G.hash, 'p:' .. g) == 0 then return 0 end
if groups.ready(G, g) then
  wake_idle(KEYS[1], ARGV[3], q, math.min(100, redis.call('LLEN', G.list .. g) + redis.call('ZCARD', G.prio .. g)))
end
return 1
