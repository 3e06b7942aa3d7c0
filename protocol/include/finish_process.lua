-- include/finish_process.lua: finish_begin, finish_process, finish_all,
-- finish_writes (with finish_notify and finish_payload, which they use),
-- what finish.lua, finish_results.lua and finish_claim.lua share (the
-- worker, its keys and the done channel are given to finish_begin); needs:
--!include include/record_head.lua
--!include include/call_chunked.lua
--!include include/nudge.lua
--!include include/task_weight.lua
--!include include/add_share.lua
--!include include/forget_weight.lua
--!include include/group.lua
--!include include/blob.lua
--!include include/enqueue_time_finish.lua

-- The state of one finish call, in upvalues (cheaper per process than the
-- fields of a table): W's record prefix, the awaiting key, the ids and
-- payloads to clear, whether any task weighs other than 1 and whether to
-- publish (each read once, when first needed).
local fin_worker, fin_wz, fin_awaiting, fin_gone, fin_seen, fin_attempts, fin_weighted, fin_notify
local fin_plain, fin_payloads, fin_procs, fin_held, fin_pers, fin_att, fin_share, fin_channel
-- the length from which a record of a plain one-shot task may hold a stand-in
local fin_long
-- the groups of the jobs that finished (one entry per job, nil for none),
-- and the payloads of the copies that left that may be stand-ins
-- (include/blob.lua; nil for none): both dealt with in finish_writes, so
-- that a finish of plain tasks makes no function of theirs
local fin_groups, fin_blobs

-- Start a finish call of W (`worker`) on Q: `procs`, `held`, `persistent`,
-- `attempts`, `share` are Q's keys {ns}:procs:<Q>, {ns}:held:<W>:<Q>,
-- {ns}:persistent:<Q>, {ns}:attempts:<Q>, {ns}:share:<Q>; `awaiting` is the
-- optional {ns}:awaiting:<Q> key (nil: done messages are always
-- published), `channel` the done channel {ns}:done:<Q>; `payloads`:
-- whether finish_process must return each payload (false: it may return
-- true). Returns W's record prefix.
local function finish_begin(worker, procs, held, persistent, attempts, share, awaiting, channel, payloads)
  fin_procs, fin_held, fin_pers, fin_att, fin_share = procs, held, persistent, attempts, share
  fin_worker, fin_wz = worker, worker .. '\0'
  fin_awaiting, fin_channel, fin_payloads = awaiting, channel, payloads
  -- The head of W's record of a plain one-shot task on its first attempt
  -- (include/record.lua): the usual case, told by one plain find.
  fin_plain = fin_wz .. 'o\0' .. '0\0'
  -- a stand-in's record: the head, five more fields (10 bytes or more) and
  -- a stand-in; a shorter record is told by its length alone
  fin_long = #fin_plain + 10 + BLOB_SHORTEST
  fin_gone, fin_seen, fin_attempts = {}, {}, {}
  fin_groups, fin_blobs = nil, nil  -- made with the first of each
  enqt_watch(procs)  -- include/enqueue_time.lua: one EXISTS
  return fin_wz
end

-- Whether done messages are published (read once per call).
local function finish_notify()
  if fin_notify == nil then
    fin_notify = not fin_awaiting or redis.call('EXISTS', fin_awaiting) == 1
  end
  return fin_notify
end

-- The payload of a record (its last field).
local function finish_payload(rec)
  return string.match(rec, '^[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z(.*)$')
end

-- Finish process `id` whose record (HMGET) is `rec`, if it is W's live
-- process: its task leaves (a persistent one's weight leaves W's held
-- weight and, if the task was W's, the sums), and its payload is published
-- on the done channel (while `awaiting` exists, if given). Returns the
-- payload (or true, for a plain one-shot task when finish_begin was not
-- asked for payloads), or false (not W's, or a repeated id: nothing
-- changes). A group's job frees its group's slot, and a stand-in's copy
-- drops its reference, in finish_writes.
local function finish_process(id, rec)
  if not rec or fin_seen[id] then return false end
  fin_seen[id] = true
  -- a one-shot task on its first attempt (the usual case, told by one plain
  -- find), or a group's job ('g' level group: include/record.lua) on its
  -- first attempt: no weight, no attempts to clear, and its payload only
  -- read where it is published or asked for
  local first = string.find(rec, fin_plain, 1, true) == 1
  if not first and string.byte(rec, #fin_wz + 1) == 103 and string.sub(rec, 1, #fin_wz) == fin_wz then
    local ks = #fin_wz + 1
    local e = string.find(rec, '\0', ks, true)
    if e and string.byte(rec, e + 1) == 48 and string.byte(rec, e + 2) == 0 then
      fin_groups = fin_groups or {}
      fin_groups[#fin_groups + 1] = string.sub(rec, ks + 2, e - 1)
      first = true
    end
  end
  if first then
    fin_gone[#fin_gone + 1] = id
    if #rec >= fin_long and string.find(rec, '\0\0mesh-blob\0', 1, true) then
      fin_blobs = fin_blobs or {}
      fin_blobs[#fin_blobs + 1] = finish_payload(rec)
    end
    local payload = (fin_payloads or enqt_fin) and finish_payload(rec)
    if enqt_fin then enqt_fin_gone[#enqt_fin_gone + 1] = payload end
    if finish_notify() then
      payload = payload or finish_payload(rec)
      nudge(fin_channel, payload)
    end
    return payload or true
  end
  local kind, tries, payload = record_head(rec, fin_wz)
  if not kind then return false end
  fin_gone[#fin_gone + 1] = id
  local persistent = kind == 'p'
  -- a copy that leaves for good (a one-shot task's; a persistent task's if
  -- it was W's) and may be a stand-in
  local leaves = #payload >= BLOB_SHORTEST and not persistent
  if persistent then
    if fin_weighted == nil then fin_weighted = redis.call('HEXISTS', fin_share, ':heavy') == 1 end
    local w = fin_weighted and task_weight(fin_share, payload) or 1
    -- HDEL before HINCRBY: the first write must be one Redis does not
    -- refuse at the memory limit (see "At the memory limit" in README.md)
    local mine = redis.call('HGET', fin_pers, payload) == id
    if mine then redis.call('HDEL', fin_pers, payload) end
    add_share(fin_share, 'h' .. fin_worker, 1 - w)  -- its weight leaves W's held weight
    if mine then
      forget_weight(fin_share, payload)  -- the task leaves: its weight leaves the sums
      leaves = #payload >= BLOB_SHORTEST
    end
  end
  if leaves then
    fin_blobs = fin_blobs or {}
    fin_blobs[#fin_blobs + 1] = payload
  end
  if persistent or tries ~= '0' then fin_attempts[#fin_attempts + 1] = payload end
  if enqt_fin and not persistent then enqt_fin_gone[#enqt_fin_gone + 1] = payload end
  if string.byte(kind, 1) == 103 then
    fin_groups = fin_groups or {}
    fin_groups[#fin_groups + 1] = string.sub(kind, 3)
  end
  if finish_notify() then nudge(fin_channel, payload) end
  return payload
end

-- finish_process of each of `ids` (their records `recs`, from HMGET), in
-- order; returns their flags (1: finished, 0: not W's live process). The
-- usual case, a plain one-shot task on its first attempt whose payload is
-- neither asked for nor published, is done here with no call per process
-- (and string.find in a register): a finish of 30 such tasks cost Redis
-- about 300 instructions per task less (callgrind).
local function finish_all(ids, recs)
  local flags = {}
  if #ids == 0 then return flags end
  local find, plain, long, gone, seen = string.find, fin_plain, fin_long, fin_gone, fin_seen
  local quiet = not fin_payloads and not finish_notify()
  local times = enqt_fin_gone  -- a queue that keeps enqueue times: each payload's goes
  for i = 1, #ids do
    local id, rec = ids[i], recs[i]
    if quiet and rec and #rec < long and not seen[id] and find(rec, plain, 1, true) == 1 then
      seen[id] = true
      gone[#gone + 1] = id
      if times then times[#times + 1] = finish_payload(rec) end
      flags[i] = 1
    else
      flags[i] = finish_process(id, rec) and 1 or 0
    end
  end
  return flags
end

-- The writes for every finished process at once (not one of each per
-- process): their records, their ids in W's held set, their attempt counts.
local function finish_writes()
  call_chunked('HDEL', fin_procs, fin_gone)
  call_chunked('SREM', fin_held, fin_gone)
  call_chunked('HDEL', fin_att, fin_attempts)
  if enqt_fin then call_chunked('ZREM', enqt_fin, enqt_fin_gone) end
  if fin_blobs then
    local blobs = blob_lib()
    local prefix = blobs.prefix(fin_procs)
    for _, p in ipairs(fin_blobs) do blobs.unref(prefix, p) end  -- (a plain payload: a no-op)
  end
  if fin_groups then
    local groups = group_lib()
    local order, counts = {}, {}
    for _, g in ipairs(fin_groups) do groups.tally(order, counts, g) end
    groups.release_many(groups.keys_of(fin_procs, 'procs'), order, counts)
  end
end
