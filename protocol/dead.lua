-- dead.lua: work on a queue's dead letters: put them back at the back of the
-- queue with their attempts reset (mode "requeue"), each at its priority and
-- into its group (the record's kind), or drop them (mode "purge"); all of
-- them, or those whose payload is one of ARGV[4..].
--
-- KEYS[1] {ns}:dead:<Q>          LIST of dead-letter records (include/dead_record.lua)
-- KEYS[2] {ns}:queue:<Q>         LIST of queued payloads
-- KEYS[3] {ns}:attempts:<Q>      HASH payload -> failed attempts
-- KEYS[4] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[5] {ns}:standby:<Q>       SET of persistent payloads queued or delayed (those not kept as "" in the hash)
-- KEYS[6] {ns}:idle:<Q>          SET of idle servers of Q (see include/wake_idle.lua)
-- KEYS[7] {ns}:prio:<Q>          ZSET of queued tasks with a priority (include/prio_add.lua)
-- (a group's keys are made from KEYS[6]'s prefix: include/group.lua)
-- ARGV[1] queue name Q
-- ARGV[2] prefix of wake channels ({ns}:wake:), the worker id is appended
-- ARGV[3] mode: "requeue" or "purge"
-- ARGV[4..] payloads to act on; none: every dead letter of Q
-- Returns: {records requeued or purged, records left alone because their
--          payload has become a persistent task of Q (requeue only)}.
--          Running it twice: the second run finds nothing to do.
-- Errors: BAD_ARG (mode).
-- Blobs: a purged stand-in's blob loses a reference (include/blob.lua); a
--        requeued one keeps it (the dead copy becomes the queued copy).
-- Times: while Q keeps enqueue times, a requeued job's time is the requeue's
--        (include/enqueue_time.lua).
-- Publishes: after a requeue, Q on the wake channels of up to (tasks
--            requeued) + 1 idle servers of Q.
--!include include/is_persistent.lua
--!include include/call_chunked.lua
--!include include/wake_idle.lua
--!include include/prio_add.lua
--!include include/group.lua
--!include include/blob.lua
--!include include/enqueue_time.lua
local groups = group_lib()
local blobs = blob_lib()

local mode = ARGV[3]
if mode ~= 'requeue' and mode ~= 'purge' then
  return redis.error_reply('BAD_ARG mode must be "requeue" or "purge"')
end
local all = #ARGV == 3
local wanted = {}
for i = 4, #ARGV do wanted[ARGV[i]] = true end
local has_persistent = mode == 'requeue' and redis.call('EXISTS', KEYS[4], KEYS[5]) > 0

local recs = redis.call('LRANGE', KEYS[1], 0, -1)
local keep, take, kinds, refused = {}, {}, {}, 0
for _, rec in ipairs(recs) do
  -- when \0 attempts \0 worker \0 error \0 kind \0 payload
  local pos = 1
  for _ = 1, 4 do pos = string.find(rec, '\0', pos, true) + 1 end
  local cut = string.find(rec, '\0', pos, true)
  local kind, payload = string.sub(rec, pos, cut - 1), string.sub(rec, cut + 1)
  if all or wanted[payload] then
    if has_persistent and is_persistent(KEYS[4], KEYS[5], payload) then
      refused = refused + 1
      keep[#keep + 1] = rec
    else
      take[#take + 1] = payload
      kinds[#take] = kind
    end
  else
    keep[#keep + 1] = rec
  end
end
if #take == 0 then return {0, refused} end
if mode == 'requeue' then
  -- before the first write (see wake_idle)
  wake_idle(KEYS[6], ARGV[2], ARGV[1], #take)
end
redis.call('DEL', KEYS[1])
call_chunked('RPUSH', KEYS[1], keep)
if mode == 'requeue' then
  call_chunked('HDEL', KEYS[3], take)
  enqt_add(KEYS[1], ARGV[1], take, 1, #take)
  -- each to the back of its place, in order: the queue, a priority, a group
  local ungrouped, ulevels, grouped, glevels, gorder = {}, {}, {}, {}, {}
  for i, payload in ipairs(take) do
    local kind = kinds[i]
    local level = #kind > 1 and string.byte(kind, 2) - 48 or 0
    if string.byte(kind, 1) == 103 then  -- 'g' level group
      local g = string.sub(kind, 3)
      if not grouped[g] then
        grouped[g], glevels[g] = {}, {}
        gorder[#gorder + 1] = g
      end
      table.insert(grouped[g], payload)
      table.insert(glevels[g], level)
    else
      ungrouped[#ungrouped + 1] = payload
      ulevels[#ungrouped] = level
    end
  end
  local plain, order, at = prio_split(ungrouped, ulevels)
  call_chunked('RPUSH', KEYS[2], plain)
  for _, level in ipairs(order) do prio_add(KEYS[7], level, at[level], false) end
  if #gorder > 0 then
    local G = groups.keys_of(KEYS[6], 'idle')
    for _, g in ipairs(gorder) do groups.push(G, g, grouped[g], false, glevels[g]) end
  end
else
  local prefix = nil
  for _, p in ipairs(take) do
    if blobs.is(p) then
      prefix = prefix or blobs.prefix(KEYS[1])
      blobs.unref(prefix, p)
    end
  end
end
return {#take, refused}
