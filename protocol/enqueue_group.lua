-- enqueue_group.lua: put one-shot tasks at the back of a group of a queue,
-- now or after a delay (see "Groups" in README.md). A group needs nothing
-- made beforehand: its keys appear with its first job and leave with its
-- last (but for its own settings, configure_group.lua).
--
-- KEYS[1] {ns}:queues            SET of known queue names
-- KEYS[2] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[3] {ns}:standby:<Q>       SET of persistent payloads queued or delayed (those not kept as "" in the hash)
-- KEYS[4] {ns}:idle:<Q>          SET of idle servers of Q (see include/wake_idle.lua)
-- (the group's keys are made from KEYS[4]'s prefix: include/group.lua)
-- ARGV[1] queue name Q
-- ARGV[2] prefix of wake channels ({ns}:wake:), the worker id is appended
-- ARGV[3] group name G (as a queue name: 1 to 200 of A-Z a-z 0-9 _ . : / @ + = -)
-- ARGV[4] mode: "now", "in" (ARGV[5] ms from now) or "at" (ARGV[5] = the due
--         time, ms since the Unix epoch on the Redis clock; a time past is due now)
-- ARGV[5] a whole number of ms >= 0 (mode "now": ignored)
-- ARGV[6] priority: 0 (none) or 1..9 (the group's jobs with a priority start
--         before its others, the highest first, each level in order)
-- ARGV[7..] payloads, in order
-- Returns: {the group's queued jobs afterwards (mode "now"; else the jobs
--          newly delayed), the due time in ms (Redis clock; mode "now": now),
--          now_ms}.
-- Blobs: each stand-in added counts one reference (include/blob.lua; one
--        delayed again in the group is not added).
-- Times: while Q keeps enqueue times, each payload's first enqueue time
--        (include/enqueue_time.lua).
-- Errors: CONFLICT (a payload is a persistent task of Q, or a stand-in whose
--         blob is gone: nothing was added),
--         BAD_ARG (group name, mode, time, priority), OOM (Redis is at maxmemory:
--         nothing was added).
-- Publishes: Q on the wake channels of up to n + 1 idle servers of Q (mode
--            "now", when the group may start a job; else up to two).
--!include include/now_ms.lua
--!include include/is_persistent.lua
--!include include/count_arg.lua
--!include include/group.lua
--!include include/blob.lua
--!include include/enqueue_time.lua
local groups = group_lib()
local blobs = blob_lib()

local q, g, mode = ARGV[1], ARGV[3], ARGV[4]
if not string.match(g, '^[A-Za-z0-9_.:/@+=-]+$') or #g > 200 then
  return redis.error_reply('BAD_ARG group name must be 1 to 200 of A-Z a-z 0-9 _ . : / @ + = -')
end
if mode ~= 'now' and mode ~= 'in' and mode ~= 'at' then
  return redis.error_reply('BAD_ARG mode must be "now", "in" or "at"')
end
local level = ARGV[6]
if not string.match(level, '^%d$') then
  return redis.error_reply('BAD_ARG priority must be a whole number from 0 to 9')
end
level = tonumber(level)
local ms, err = 0, nil
if mode ~= 'now' then
  ms, err = count_arg(ARGV[5], 'delay')
  if err then return err end
end
local now = now_ms()
local due = now
if mode == 'in' then due = now + ms elseif mode == 'at' then due = ms end
local n = #ARGV - 6
if redis.call('EXISTS', KEYS[2], KEYS[3]) > 0 then
  for i = 7, #ARGV do
    if is_persistent(KEYS[2], KEYS[3], ARGV[i]) then
      return redis.error_reply('CONFLICT task ' .. (i - 7) .. ' of this call is a persistent task of queue '
        .. q .. '; a payload is one-shot or persistent in a queue, not both')
    end
  end
end
local prefix = blobs.prefix(KEYS[4])
local gone, big = blobs.missing(prefix, ARGV, 7)
if gone then return blobs.gone(gone - 7) end
local delaying = mode ~= 'now' and due > now
local refs = {}  -- the stand-ins to count (delayed: only those not delayed yet)
if big then
  local G = groups.keys(prefix, q)
  for i = 7, #ARGV do
    local p = ARGV[i]
    if blobs.is(p) and not (delaying
        and (refs[p] ~= nil or redis.call('ZSCORE', G.delayed, g .. '\0d' .. level .. p))) then
      refs[#refs + 1] = p
      refs[p] = true
    end
  end
end
-- The first write is one that Redis refuses at the memory limit (SADD is
-- "denyoom"): refused, nothing is written.
redis.call('SADD', KEYS[1], q)
if n == 0 then return {0, due, now} end
for _, p in ipairs(refs) do blobs.ref(prefix, p) end
enqt_add(KEYS[1], q, ARGV, 7, #ARGV, now)
local G = groups.keys(prefix, q)
if delaying then
  local args = {}
  for i = 7, #ARGV do
    args[#args + 1] = due
    args[#args + 1] = g .. '\0d' .. level .. ARGV[i]
  end
  local added = 0
  for i = 1, #args, 4000 do
    added = added + redis.call('ZADD', G.delayed, unpack(args, i, math.min(i + 3999, #args)))
  end
  local first = redis.call('ZRANGE', G.delayed, 0, 0, 'WITHSCORES')
  if tonumber(first[2]) == due then wake_idle(KEYS[4], ARGV[2], q, 1) end
  return {added, due, now}
end
local payloads = {}
for i = 7, #ARGV do payloads[#payloads + 1] = ARGV[i] end
local len = groups.push(G, g, payloads, false, level)
if redis.call('ZSCORE', G.ready, g) then wake_idle(KEYS[4], ARGV[2], q, n) end
return {len, due, now}
