-- cancel.lua: cancel a task by payload: remove every queued (and delayed)
-- copy from Q, forget it as a persistent task, and cancel every running
-- process of it, on whatever worker it runs. The cancel is durable: the
-- process id goes to the worker's inbox (read by its heartbeat) as well as
-- to its cancel channel.
--
-- KEYS[1] {ns}:queue:<Q>         LIST of queued payloads
-- KEYS[2] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[3] {ns}:procs:<Q>         HASH process id -> process record
-- KEYS[4] {ns}:attempts:<Q>      HASH payload -> failed attempts
-- KEYS[5] {ns}:delayed:<Q>       ZSET payload -> due time
-- KEYS[6] {ns}:standby:<Q>       SET of persistent payloads queued or delayed (those not kept as "" in the hash)
-- KEYS[7] {ns}:reserved:<Q>      HASH payload -> "W:expiry": a task handed back for balance, reserved
--                                for W (removed: a queued copy)
-- KEYS[8] {ns}:unowned:<Q>        ZSET persistent payload -> since when (ms) no process runs it
-- KEYS[9] {ns}:share:<Q>         HASH weights and capacities (README.md): a
--                                persistent task's weight leaves it
-- KEYS[10] {ns}:prio:<Q>         ZSET of queued tasks with a priority (include/prio_add.lua)
-- KEYS[11] {ns}:delayed_prio:<Q> HASH payload -> priority of a delayed task
-- then for each worker W_j named in ARGV, two keys:
--   {ns}:held:<W_j>:<Q>, {ns}:inbox:<W_j>
-- then, optionally, {ns}:gq:<Q>|<G>: the copies queued in group G (and
--   waiting in it for a delay or a retry) are removed too (include/group.lua);
--   a running process of the payload is cancelled whatever its group
-- ARGV[1] the payload
-- ARGV[2] prefix of cancel channels ({ns}:cancel:), the worker id is appended
-- ARGV[3..] worker ids W_j, in the order of their keys
-- Returns: {0, queued copies removed, running processes cancelled}, or
--          {1, W...} when processes of the payload run on workers whose keys
--          were not passed (nothing changed: call again with them).
-- Errors: BAD_ARG (key count).
-- Blobs: a stand-in's blob loses the references of every copy removed (a
--        persistent task counts one, include/blob.lua).
-- Times: the payload's enqueue time goes (include/enqueue_time.lua).
-- Publishes: each cancelled process id on the cancel channel of its worker.
--!include include/record.lua
--!include include/prio_remove.lua
--!include include/cancelling.lua
--!include include/add_share.lua
--!include include/forget_weight.lua
--!include include/blob.lua
--!include include/enqueue_time_drop.lua
local groups = group_lib()
local blobs = blob_lib()

local nw = #ARGV - 2
local glist = nil
if #KEYS == 12 + 2 * nw then
  glist = KEYS[#KEYS]
elseif #KEYS ~= 11 + 2 * nw then
  return redis.error_reply('BAD_ARG expected ' .. (11 + 2 * nw) .. ' keys for ' .. nw .. ' workers')
end
local payload = ARGV[1]
local found = {}
local owner = redis.call('HGET', KEYS[2], payload)
if owner then
  local rec = redis.call('HGET', KEYS[3], owner)
  if rec then found[1] = {owner, unpack_record(rec).worker} end
end
local standby = not owner and redis.call('SISMEMBER', KEYS[6], payload) == 1
if not owner and not standby then
  found = find_processes(KEYS[3], payload)
end
local wkeys, missing = worker_keys(found, KEYS, ARGV, 2, 11, nw)
if missing then return missing end

local removed = redis.call('LREM', KEYS[1], 0, payload) + redis.call('ZREM', KEYS[5], payload)
local reserved = redis.call('HDEL', KEYS[7], payload)
if redis.call('EXISTS', KEYS[10]) == 1 then removed = removed + prio_remove(KEYS[10], payload) end
if glist then
  local G = groups.keys_of(KEYS[3], 'procs')
  local g = string.sub(glist, #G.list + 1)
  local gone = redis.call('LREM', glist, 0, payload)
  local pgone = redis.call('EXISTS', G.prio .. g) == 1 and prio_remove(G.prio .. g, payload) or 0
  gone = gone + pgone
  groups.prio_gone(G, pgone)
  if gone > 0 and redis.call('HINCRBY', G.hash, ':n', -gone) <= 0 then redis.call('HDEL', G.hash, ':n') end
  -- delayed, at any priority (the member names it: include/group.lua)
  local ds, rs = {}, {}
  for level = 0, 9 do
    ds[#ds + 1] = g .. '\0d' .. level .. payload
    rs[#rs + 1] = g .. '\0r' .. level .. payload
  end
  removed = removed + gone + redis.call('ZREM', G.delayed, unpack(ds))
  local retries = redis.call('ZREM', G.delayed, unpack(rs))
  if retries > 0 then
    removed = removed + retries
    groups.release(G, g, retries, true)  -- a retry waiting for its backoff held a slot
  end
end
redis.call('HDEL', KEYS[11], payload)
redis.call('HDEL', KEYS[2], payload)
redis.call('SREM', KEYS[6], payload)
redis.call('ZREM', KEYS[8], payload)
redis.call('HDEL', KEYS[4], payload)
enqt_drop(KEYS[1], 'queue', {payload})
if owner or standby then
  local w = forget_weight(KEYS[9], payload)
  if found[1] then add_share(KEYS[9], 'h' .. found[1][2], 1 - w) end
end
cancel_found(found, KEYS[3], wkeys, ARGV[2])
if #payload >= BLOB_SHORTEST then
  -- a persistent task is one copy wherever it is; one-shot copies count each
  local copies = (owner or standby) and 1 or removed + #found
  if copies > 0 then blobs.unref(blobs.prefix(KEYS[1]), payload, copies) end
end
return {0, removed + reserved, #found}
