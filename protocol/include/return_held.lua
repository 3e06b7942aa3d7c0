-- include/return_held.lua: return_held; needs:
--!include include/int.lua
--!include include/record.lua
--!include include/next_attempt.lua
--!include include/dead_record.lua
--!include include/sorted_ids.lua
--!include include/call_chunked.lua
--!include include/hmget_all.lua
--!include include/prio_add.lua
--!include include/delay_level.lua
--!include include/to_standby.lua
--!include include/group.lua
--!include include/blob.lua
--!include include/enqueue_time_drop.lua

-- Hand every process in `held` (a worker's set of process ids on one queue)
-- back to the front of `queue`, oldest claim first. With count_attempt (the
-- worker crashed), the crash counts as a failed attempt of each task: the
-- first goes back to the front at once, a repeated one waits in `delayed`
-- for its backoff, and a one-shot task at its max_attempts goes to `dead`.
-- A persistent task leaves `persistent` as running, and is kept as queued
-- (see to_standby). A task with a priority goes to the front (or back) of
-- its level in `prio`, and keeps its level in `dprio` while delayed (see
-- prio_add). One Redis call per kind of write, not one per process.
-- Returns (handed back or delayed, dead-lettered, and per dead-lettered task
-- {the first 161 bytes of its payload, attempts made, max attempts}: for the
-- caller's log line).
local function return_held(held, procs, queue, persistent, attempts, dead, delayed, count_attempt,
                           now, standby, unowned, prio, dprio)
  local ids = sorted_ids(redis.call('SMEMBERS', held))
  if #ids == 0 then return 0, 0, {} end
  local groups, blobs = group_lib(), blob_lib()
  local recs = hmget_all(procs, ids)
  -- newest claim first: the last LPUSHed, the oldest, ends up at the head
  local rs, nums = {}, {}
  for i = #ids, 1, -1 do
    if recs[i] then
      local r = unpack_record(recs[i], nums)
      r.id = ids[i]
      rs[#rs + 1] = r
    end
  end
  -- With count_attempt: every payload's count read in one HMGET, counted
  -- here in the order above (a payload may run twice), written back in one
  -- HSET and one HDEL.
  local count, order = {}, {}
  if count_attempt and #rs > 0 then
    for _, r in ipairs(rs) do
      if count[r.payload] == nil then
        count[r.payload] = 0
        order[#order + 1] = r.payload
      end
    end
    local vals = hmget_all(attempts, order)
    for i, p in ipairs(order) do count[p] = vals[i] and cached_number(nums, vals[i]) or 0 end
  end
  local keep = {}
  local gone, front, back_end, later, buried, pers = {}, {}, {}, {}, {}, {}
  local leveled, nleveled, told = {}, 0, {}
  local dead_payloads = {}  -- their enqueue times go (include/enqueue_time.lua)
  -- a group's jobs go back to the front of their group (include/group.lua),
  -- newest claim first here as in `front`; a retry that waits for its
  -- backoff keeps its group's slot until due (a group without a cap counts
  -- it now: include/group.lua, group_hold_many)
  local G, gfront, gfreed, gorder, glater, gheld, ghorder = nil, {}, {}, {}, {}, {}, {}
  local gseen = {}  -- the retries' members so far
  for _, r in ipairs(rs) do
    gone[#gone + 1] = r.id
    local where, delay = 'front', 0
    local made = 0
    if count_attempt then
      local a
      a, where, delay, made = next_attempt(r, now, count[r.payload], r.backoff, r.backoff_cap, true)
      count[r.payload] = a or 0
      keep[r.payload] = a
    end
    if r.group then
      if not G then G = groups.keys_of(procs, 'procs') end
      if where == 'later' then
        local member = r.group .. '\0r' .. r.level .. r.payload
        glater[#glater + 1] = now + delay
        glater[#glater + 1] = member
        if gseen[member] or redis.call('ZSCORE', G.delayed, member) then
          groups.tally(gorder, gfreed, r.group)  -- a retry of the same payload waits: one slot for both
        else
          gseen[member] = true
          groups.tally(ghorder, gheld, r.group)
        end
      else
        groups.tally(gorder, gfreed, r.group)
        if where == 'dead' then
          buried[#buried + 1] = dead_record(now, made, r.worker,
            'worker crashed: the lease of worker ' .. r.worker .. ' expired', r.kind, r.payload)
          told[#told + 1] = {string.sub(r.payload, 1, 161), made, r.max_attempts}
          dead_payloads[#dead_payloads + 1] = r.payload
        else
          gfront[#gfront + 1] = {r.payload, r.group, r.level}
        end
      end
    elseif where == 'dead' then
      buried[#buried + 1] = dead_record(now, made, r.worker,
        'worker crashed: the lease of worker ' .. r.worker .. ' expired', r.kind, r.payload)
      told[#told + 1] = {string.sub(r.payload, 1, 161), made, r.max_attempts}
      dead_payloads[#dead_payloads + 1] = r.payload
    else
      if r.persistent then
        pers[#pers + 1] = r.payload
      end
      if r.level > 0 and where ~= 'later' then
        local l = leveled[r.level]
        if not l then
          l = {front = {}, back = {}}
          leveled[r.level] = l
        end
        table.insert(where == 'front' and l.front or l.back, r.payload)
      elseif where == 'front' then
        front[#front + 1] = r.payload
      elseif where == 'later' then
        later[#later + 1] = now + delay
        later[#later + 1] = r.payload
        if r.level > 0 then delay_level(dprio, r.payload, r.level) end
      else
        back_end[#back_end + 1] = r.payload
      end
    end
  end
  local kept, forgot, digits = {}, {}, {}
  for _, p in ipairs(order) do
    local a = keep[p]
    if a then
      -- the counts as strings, each converted once (most are 1)
      local d = digits[a]
      if not d then
        d = int(a)
        digits[a] = d
      end
      kept[#kept + 1] = p
      kept[#kept + 1] = d
    else
      forgot[#forgot + 1] = p
    end
  end
  call_chunked('HSET', attempts, kept, 2)
  call_chunked('HDEL', attempts, forgot)
  call_chunked('HDEL', procs, gone)
  to_standby(persistent, standby, pers, true, unowned, now)
  call_chunked('LPUSH', queue, front)
  blobs.merge_pairs(delayed, later, 0)
  call_chunked('ZADD', delayed, later, 2)
  call_chunked('RPUSH', queue, back_end)
  call_chunked('RPUSH', dead, buried)
  enqt_drop(procs, 'procs', dead_payloads)
  for level, l in pairs(leveled) do
    -- newest claim first in l.front: the oldest goes first
    local f = {}
    for i = #l.front, 1, -1 do f[#f + 1] = l.front[i] end
    prio_add(prio, level, f, true)
    prio_add(prio, level, l.back, false)
    nleveled = nleveled + #l.front + #l.back
  end
  redis.call('DEL', held)
  if G then
    -- gfront is newest claim first: the oldest goes first at each front
    local back, levels, border = {}, {}, {}
    for i = #gfront, 1, -1 do
      local j = gfront[i]
      if not back[j[2]] then
        back[j[2]], levels[j[2]] = {}, {}
        border[#border + 1] = j[2]
      end
      table.insert(back[j[2]], j[1])
      table.insert(levels[j[2]], j[3])
    end
    for _, g in ipairs(border) do groups.push(G, g, back[g], true, levels[g]) end
    blobs.merge_pairs(G.delayed, glater, nil)
    call_chunked('ZADD', G.delayed, glater, 2)
    groups.release_many(G, gorder, gfreed)
    groups.hold_many(G, ghorder, gheld)
  end
  return #front + #later / 2 + #back_end + nleveled + #gfront + #glater / 2, #buried, told
end
