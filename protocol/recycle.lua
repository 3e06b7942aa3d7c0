-- recycle.lua: put every process of a worker back at the front of its queue
-- and remove the worker. Mode "dead": a peer recycles a worker whose lease
-- expired (refused while the heartbeat key exists); the crash counts as a
-- failed attempt of each task: its first failure goes back to the front at
-- once, a repeated one waits for the claiming worker's backoff in the
-- delayed set (a task that kills every worker does not take the fleet down
-- one TTL at a time), and a one-shot task at its limit is dead-lettered. Mode
-- "leave": the worker itself leaves (graceful stop, or after it found itself
-- fenced); no attempt is counted. Safe to run twice: the second run finds
-- nothing left and returns {0, 0, 0}.
--
-- KEYS[1] {ns}:worker:<W>    heartbeat key
-- KEYS[2] {ns}:workers       ZSET lease deadlines
-- KEYS[3] {ns}:info          HASH worker descriptions
-- KEYS[4] {ns}:serves:<W>    SET of queues W serves
-- KEYS[5] {ns}:inbox:<W>     SET of W's unacknowledged cancels
-- then for each queue Q_i named in ARGV, nine keys:
--   {ns}:held:<W>:<Q>, {ns}:procs:<Q>, {ns}:queue:<Q>, {ns}:persistent:<Q>,
--   {ns}:attempts:<Q>, {ns}:dead:<Q>, {ns}:servers:<Q>, {ns}:delayed:<Q>,
--   {ns}:standby:<Q>
-- ARGV[1] worker id W
-- ARGV[2] mode: "dead" or "leave"
-- ARGV[3] incarnation (mode "leave"; ignored for "dead")
-- ARGV[4] prefix of work channels ({ns}:work:), the queue name is appended
-- ARGV[5..] the queue names Q_i, in the order of their keys
-- Returns: {0, handed back (or delayed), dead-lettered} when done;
--          {1} when the worker is alive (mode "dead": nothing changed but
--          its deadline in {ns}:workers, set back to its key's PTTL);
--          {2, Q...} when W serves queues whose keys were not passed
--          (nothing changed: call again with those queues' keys too).
-- Errors: BAD_ARG (mode, key count), FENCED (mode "leave" and the lease is
--         held by another incarnation).
-- Publishes: per queue, the number of tasks put back on its work channel.
--!include lib.lua

local mode = ARGV[2]
if mode ~= 'dead' and mode ~= 'leave' then
  return redis.error_reply('BAD_ARG mode must be "dead" or "leave"')
end
local nq = #ARGV - 4
if #KEYS ~= 5 + 9 * nq then
  return redis.error_reply('BAD_ARG expected ' .. (5 + 9 * nq) .. ' keys for ' .. nq .. ' queues')
end
if mode == 'dead' then
  local left = redis.call('PTTL', KEYS[1])
  if left ~= -2 then
    -- alive after all (it renewed in the same millisecond): put its true
    -- deadline back, which a reap lease may have moved
    if left >= 0 then redis.call('ZADD', KEYS[2], 'XX', now_ms() + left, ARGV[1]) end
    return {1}
  end
else
  local v = redis.call('GET', KEYS[1])
  if v and v ~= ARGV[3] then
    return redis.error_reply('FENCED worker ' .. ARGV[1] .. ' lease superseded')
  end
end
local given = {}
for i = 5, #ARGV do given[ARGV[i]] = true end
local missing = {2}
for _, q in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  if not given[q] then missing[#missing + 1] = q end
end
if #missing > 1 then return missing end

local now = now_ms()
local back, buried = 0, 0
for i = 1, nq do
  local k = 5 + 9 * (i - 1)
  local b, d = return_held(KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5],
    KEYS[k + 6], KEYS[k + 8], mode == 'dead', now, KEYS[k + 9])
  redis.call('SREM', KEYS[k + 7], ARGV[1])
  if b > 0 then redis.call('PUBLISH', ARGV[4] .. ARGV[4 + i], b) end
  back, buried = back + b, buried + d
end
redis.call('DEL', KEYS[1], KEYS[4], KEYS[5])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return {0, back, buried}
