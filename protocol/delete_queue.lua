-- delete_queue.lua: delete a queue with everything in it: queued, delayed and
-- dead-lettered tasks, persistent tasks, its groups (their jobs and
-- settings: include/group.lua), and every running process (each is
-- cancelled as by cancel.lua). Workers that serve Q go on serving it, empty.
--
-- KEYS[1] {ns}:queue:<Q>
-- KEYS[2] {ns}:persistent:<Q>
-- KEYS[3] {ns}:procs:<Q>
-- KEYS[4] {ns}:attempts:<Q>
-- KEYS[5] {ns}:delayed:<Q>
-- KEYS[6] {ns}:dead:<Q>
-- KEYS[7] {ns}:queues
-- KEYS[9] {ns}:moving:<Q>, KEYS[10] {ns}:reserved:<Q> (rebalancing; deleted)
-- KEYS[8] {ns}:standby:<Q>
-- KEYS[11] {ns}:unowned:<Q> (deleted)
-- KEYS[12] {ns}:share:<Q>  (task weights and held weights removed; the
--          servers' capacities stay: they go on serving Q)
-- KEYS[13] {ns}:prio:<Q>, KEYS[14] {ns}:delayed_prio:<Q> (priorities; deleted)
-- then for each worker W_j named in ARGV, two keys:
--   {ns}:held:<W_j>:<Q>, {ns}:inbox:<W_j>
-- ARGV[1] queue name Q
-- ARGV[2] prefix of cancel channels ({ns}:cancel:)
-- ARGV[3] the delete channel of Q ({ns}:delete:<Q>)
-- ARGV[4..] worker ids W_j, in the order of their keys
-- Returns: {0, queued, delayed and dead-lettered tasks removed, processes
--          cancelled}, or
--          {1, W...} as cancel.lua.
-- Errors: BAD_ARG (key count).
-- Blobs: a stand-in's blob loses the references of every copy deleted (a
--        persistent task counts one; include/blob.lua). Costs a pass over
--        the queue's entries (in chunks) to find them.
-- Times: Q's enqueue times are deleted; {ns}:timed keeps Q (its policy stays)
--        (include/enqueue_time.lua). So is Q's attempt history
--        ({ns}:tries:<Q>, {ns}:tried:<Q>).
-- Publishes: each cancelled process id on its worker's cancel channel, then
--            "" on the delete channel.
--!include include/call_chunked.lua
--!include include/nudge.lua
--!include include/cancelling.lua
--!include include/blob.lua
local groups = group_lib()
local blobs = blob_lib()

local nw = #ARGV - 3
if #KEYS ~= 14 + 2 * nw then
  return redis.error_reply('BAD_ARG expected ' .. (14 + 2 * nw) .. ' keys for ' .. nw .. ' workers')
end
local found = find_processes(KEYS[3], false)
local wkeys, missing = worker_keys(found, KEYS, ARGV, 3, 14, nw)
if missing then return missing end

-- The copies of stand-ins among what goes (include/blob.lua): counted now,
-- their references dropped after the deletes.
local refs, pers = {}, {}
local function tally(p, skip)
  if blobs.is(p) and not (skip and pers[p]) then
    if not refs[p] then refs[#refs + 1] = p end
    refs[p] = (refs[p] or 0) + 1
  end
end
local function scan(key, shape, cut)
  local len = redis.call(shape == 'list' and 'LLEN' or 'ZCARD', key)
  for i = 0, len - 1, 1000 do
    for _, m in ipairs(redis.call(shape == 'list' and 'LRANGE' or 'ZRANGE', key, i, i + 999)) do
      tally(cut and cut(m) or m, true)
    end
  end
end
do
  local ph = redis.call('HGETALL', KEYS[2])
  for i = 1, #ph, 2 do pers[ph[i]] = true; tally(ph[i]) end
  for _, p in ipairs(redis.call('SMEMBERS', KEYS[8])) do pers[p] = true; tally(p) end
  local procs = redis.call('HGETALL', KEYS[3])  -- the documented ACL has no HVALS
  for i = 2, #procs, 2 do
    local rec = procs[i]
    if string.find(rec, '\0\0mesh-blob\0', 1, true) and not string.match(rec, '^[^%z]*%zp%z') then
      tally(unpack_record(rec).payload)
    end
  end
  scan(KEYS[1], 'list')
  scan(KEYS[5], 'zset')
  scan(KEYS[13], 'zset', function(m) return string.sub(m, 17) end)
  scan(KEYS[6], 'list', function(rec)  -- a dead letter: the payload is last
    return string.match(rec, '^[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z(.*)$') or ''
  end)
end
local removed = redis.call('LLEN', KEYS[1]) + redis.call('ZCARD', KEYS[5])
  + redis.call('LLEN', KEYS[6]) + redis.call('HLEN', KEYS[10]) + redis.call('ZCARD', KEYS[13])
cancel_found(found, KEYS[3], wkeys, ARGV[2])
-- Q's groups (include/group.lua): every group with a key is named in one of
-- the ready, waiting or delayed sets or the groups hash
local G = groups.keys_of(KEYS[3], 'procs')
local named, names = {}, {}
local function name(g)
  if g ~= '' and not named[g] then
    named[g] = true
    names[#names + 1] = g
  end
end
for _, g in ipairs(redis.call('ZRANGE', G.ready, 0, -1)) do name(g) end
for _, g in ipairs(redis.call('ZRANGE', G.wait, 0, -1)) do name(g) end
for _, m in ipairs(redis.call('ZRANGE', G.delayed, 0, -1)) do name(string.match(m, '^([^%z]*)')) end
local gfields = redis.call('HGETALL', G.hash)
for i = 1, #gfields, 2 do
  local f = gfields[i]
  if string.sub(f, 2, 2) == ':' and f ~= ':v' then name(string.sub(f, 3)) end
end
removed = removed + redis.call('ZCARD', G.delayed)
-- (a member: G, a NUL byte, the flag, the level, the payload)
scan(G.delayed, 'zset', function(m) return string.sub(m, string.find(m, '\0', 1, true) + 3) end)
for _, g in ipairs(names) do
  removed = removed + redis.call('LLEN', G.list .. g) + redis.call('ZCARD', G.prio .. g)
  scan(G.list .. g, 'list')
  scan(G.prio .. g, 'zset', function(m) return string.sub(m, 17) end)
  redis.call('DEL', G.list .. g, G.prio .. g, G.rate .. g)
end
redis.call('DEL', G.ready, G.wait, G.delayed, G.hash)
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[8], KEYS[9],
  KEYS[10], KEYS[11], KEYS[13], KEYS[14])
-- the enqueue times ({ns}:enqt:<Q>: include/enqueue_time.lua) and the
-- attempt history ({ns}:tries:<Q>, {ns}:tried:<Q>: give_back.lua), made
-- from the namespace's prefix as the group keys are
local ns = string.match(KEYS[7], '^(%b{}:)')
redis.call('DEL', ns .. 'enqt:' .. ARGV[1], ns .. 'tries:' .. ARGV[1], ns .. 'tried:' .. ARGV[1])
redis.call('SREM', KEYS[7], ARGV[1])
local gone = {}
local fields = redis.call('HGETALL', KEYS[12])  -- HGETALL: the documented ACL has no HKEYS
for i = 1, #fields, 2 do
  local f = fields[i]
  local kind = string.sub(f, 1, 1)
  if kind == 'w' or kind == 'h' or f == ':weight' or f == ':heavy' then gone[#gone + 1] = f end
end
call_chunked('HDEL', KEYS[12], gone)
if #gone > 0 then redis.call('HINCRBY', KEYS[12], ':gen', 1) end
local prefix = blobs.prefix(KEYS[1])
for _, p in ipairs(refs) do blobs.unref(prefix, p, refs[p]) end
nudge(ARGV[3], '')
return {0, removed, #found}
