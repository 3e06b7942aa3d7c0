-- recycle.lua: put every process of one or more workers back at the front of
-- its queue and remove the workers. Mode "dead": a peer recycles workers
-- whose lease expired (each one whose heartbeat key still exists is left
-- alone); the crash counts as a failed attempt of each task: its first
-- failure goes back to the front at once, a repeated one waits for the
-- claiming worker's backoff in the delayed set (a task that kills every
-- worker does not take the fleet down one TTL at a time), and a one-shot task
-- at its limit is dead-lettered. Mode "leave": one worker leaves by itself
-- (graceful stop, or after it found itself fenced); no attempt is counted.
-- Several dead workers recycled in one call wake the idle servers of a queue
-- once per call, not once per worker. Safe to run twice: the second run finds
-- nothing left, recycles nobody and returns {0, 0, 0, 0, {}, {}}.
--
-- KEYS[1] {ns}:workers       ZSET lease deadlines
-- KEYS[2] {ns}:info          HASH worker descriptions
-- then for each worker W_j named in ARGV (j = 1..n), three keys:
--   {ns}:worker:<W_j> (heartbeat key), {ns}:serves:<W_j> (SET of queues it
--   serves), {ns}:inbox:<W_j> (SET of its unacknowledged cancels)
-- then for each queue Q_i named in ARGV (i = 1..m), thirteen keys:
--   {ns}:procs:<Q>, {ns}:queue:<Q>, {ns}:persistent:<Q>, {ns}:attempts:<Q>,
--   {ns}:dead:<Q>, {ns}:servers:<Q>, {ns}:delayed:<Q>, {ns}:standby:<Q>,
--   {ns}:idle:<Q>, {ns}:unowned:<Q>, {ns}:share:<Q> (the worker's capacity and
--   held weight leave it), {ns}:prio:<Q>, {ns}:delayed_prio:<Q> (a task with
--   a priority goes back to its level: include/return_held.lua)
-- then for each worker j and each queue i (worker by worker), one key:
--   {ns}:held:<W_j>:<Q_i>
-- ARGV[1] mode: "dead" or "leave"
-- ARGV[2] incarnation (mode "leave"; ignored for "dead")
-- ARGV[3] prefix of wake channels ({ns}:wake:), the worker id is appended
-- ARGV[4] n, the number of workers (1..1000; exactly 1 in mode "leave")
-- ARGV[5..4+n] the worker ids W_j, then the queue names Q_i, in the order of
--   their keys. A queue that a worker does not serve is harmless.
-- Returns: {0, handed back (or delayed), dead-lettered, workers recycled,
--           {ids of workers found alive}, {per dead-lettered task: its
--           queue, the first 161 bytes of its payload, attempts made, max
--           attempts, the worker}} when done (the caller logs a line per
--           dead-lettered task). A worker counts as
--          recycled if anything of it was left (a lease deadline, a
--          description, a process); one found alive (mode "dead": it renewed
--          in the same millisecond) is left as it was, but for its deadline
--          in {ns}:workers, set back to its key's PTTL.
--          {2, Q...} when a worker to recycle serves queues whose keys were
--          not passed (nothing changed: call again with those queues too).
-- Errors: BAD_ARG (mode, worker count, key count), FENCED (mode "leave" and
--         the lease is held by another incarnation).
-- Times: a dead-lettered job's enqueue time goes; a returned one keeps it
--        (include/enqueue_time.lua, through include/return_held.lua).
-- Publishes: per queue with tasks put back, the queue name on the wake
--            channels of up to (tasks put back) + 1 of its idle servers, once
--            per call (see include/wake_idle.lua).
--!include include/now_ms.lua
--!include include/count_arg.lua
--!include include/return_held.lua
--!include include/wake_idle.lua
--!include include/leave_share.lua

local mode = ARGV[1]
if mode ~= 'dead' and mode ~= 'leave' then
  return redis.error_reply('BAD_ARG mode must be "dead" or "leave"')
end
local n, err = count_arg(ARGV[4], 'worker count', 1000)
if err then return err end
if n < 1 or (mode == 'leave' and n ~= 1) or 4 + n > #ARGV then
  return redis.error_reply('BAD_ARG worker count must be 1 in mode "leave", 1 to 1000 in mode "dead"')
end
local m = #ARGV - 4 - n
if #KEYS ~= 2 + 3 * n + 13 * m + n * m then
  return redis.error_reply('BAD_ARG expected ' .. (2 + 3 * n + 13 * m + n * m) .. ' keys for '
    .. n .. ' workers and ' .. m .. ' queues')
end
local qbase = 2 + 3 * n             -- queue i's keys are KEYS[qbase + 13(i-1) + 1..13]
local hbase = qbase + 13 * m        -- held key of (j, i) is KEYS[hbase + m(j-1) + i]

-- Check everything before the first write.
local given = {}
for i = 1, m do given[ARGV[4 + n + i]] = true end
local todo, alive, missing, seen = {}, {}, {2}, {}
for j = 1, n do
  local w, hb = ARGV[4 + j], KEYS[3 + 3 * (j - 1)]
  local live = false
  if mode == 'dead' then
    live = redis.call('PTTL', hb) ~= -2
  else
    local v = redis.call('GET', hb)
    if v and v ~= ARGV[2] then
      return redis.error_reply('FENCED worker ' .. w .. ' lease superseded')
    end
  end
  if live then
    alive[#alive + 1] = j
  else
    todo[#todo + 1] = j
    for _, q in ipairs(redis.call('SMEMBERS', KEYS[4 + 3 * (j - 1)])) do
      if not given[q] and not seen[q] then
        seen[q] = true
        missing[#missing + 1] = q
      end
    end
  end
end
if #missing > 1 then return missing end

local out, alive_ids, told = {0, 0, 0, 0}, {}, {}
for _, j in ipairs(alive) do
  -- alive after all: put its true deadline back, which a reap lease may have moved
  local left = redis.call('PTTL', KEYS[3 + 3 * (j - 1)])
  -- (ZREM, then ZADD: ZADD XX as the first write would be refused at the
  -- memory limit; see "At the memory limit" in README.md)
  if left >= 0 and redis.call('ZREM', KEYS[1], ARGV[4 + j]) == 1 then
    redis.call('ZADD', KEYS[1], now_ms() + left, ARGV[4 + j])
  end
  alive_ids[#alive_ids + 1] = ARGV[4 + j]
end

local now = now_ms()
local back_q = {}
for i = 1, m do back_q[i] = 0 end
for _, j in ipairs(todo) do
  local w, wk = ARGV[4 + j], 3 * (j - 1)
  local known = redis.call('ZREM', KEYS[1], w) + redis.call('HDEL', KEYS[2], w)
  local back, buried = 0, 0
  for i = 1, m do
    local q = qbase + 13 * (i - 1)
    local b, d, dl = return_held(KEYS[hbase + m * (j - 1) + i], KEYS[q + 1], KEYS[q + 2],
      KEYS[q + 3], KEYS[q + 4], KEYS[q + 5], KEYS[q + 7], mode == 'dead', now, KEYS[q + 8],
      KEYS[q + 10], KEYS[q + 12], KEYS[q + 13])
    local server = redis.call('SREM', KEYS[q + 6], w) == 1
    redis.call('SREM', KEYS[q + 9], w)
    leave_share(KEYS[q + 11], w, server)
    back_q[i] = back_q[i] + b
    back, buried = back + b, buried + d
    for _, t in ipairs(dl) do
      told[#told + 1] = {ARGV[4 + n + i], t[1], t[2], t[3], w}
    end
  end
  redis.call('DEL', KEYS[3 + wk], KEYS[4 + wk], KEYS[5 + wk])
  if known > 0 or back + buried > 0 then out[4] = out[4] + 1 end
  out[2], out[3] = out[2] + back, out[3] + buried
end
for i = 1, m do
  wake_idle(KEYS[qbase + 13 * (i - 1) + 9], ARGV[3], ARGV[4 + n + i], back_q[i])
end
out[5], out[6] = alive_ids, told
return out
