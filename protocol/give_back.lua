-- give_back.lua: a worker returns processes it holds: as given back unharmed
-- (mode "return": to the front of the queue at once) or as failed (mode
-- "fail": a one-shot task counts a failed attempt and is retried after a
-- backoff, or goes to the dead-letter list at its attempt limit; a persistent
-- task is retried after a backoff, without limit), or kept for W (mode
-- "keep", a sticky restart: each persistent task waits reserved for W in
-- KEYS[11] for ARGV[3] ms, and W, back under the same id in that time,
-- claims it first; after that it goes to the head of the queue for anyone;
-- a one-shot task goes to the front as with "return").
--
-- KEYS[1] {ns}:procs:<Q>         HASH process id -> process record
-- KEYS[2] {ns}:held:<W>:<Q>      SET of W's process ids on Q
-- KEYS[3] {ns}:queue:<Q>         LIST of queued payloads
-- KEYS[4] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[5] {ns}:attempts:<Q>      HASH payload -> failed attempts
-- KEYS[6] {ns}:delayed:<Q>       ZSET payload -> due time (ms)
-- KEYS[7] {ns}:dead:<Q>          LIST of dead-letter records (include/dead_record.lua)
-- KEYS[8] {ns}:standby:<Q>       SET of persistent payloads queued or delayed (those not kept as "" in the hash); a
--                                given-back one moves there from KEYS[4]
-- KEYS[9] {ns}:idle:<Q>          SET of idle servers of Q (see include/wake_idle.lua)
-- KEYS[10] {ns}:moving:<Q>       HASH process id -> "R:expiry ms": processes a rebalance asked
--                                their worker to hand back, for worker R (see rebalance.lua)
-- KEYS[11] {ns}:reserved:<Q>     HASH payload -> "R:expiry ms": such a process handed back (mode
--                                "return") goes there, reserved for R, instead of to the front
--                                of the queue, and R is woken (on its own wake channel)
-- KEYS[12] {ns}:unowned:<Q>        ZSET persistent payload -> since when (ms) no process runs it
-- KEYS[13] {ns}:share:<Q>        HASH weights and capacities (README.md): the
--                                weight of each persistent task given back
--                                leaves W's held weight; a reservation moves
--                                its generation on
-- KEYS[14] {ns}:prio:<Q>         ZSET of queued tasks with a priority: a task with one goes
--                                back to the front (retried: the back) of its level (include/prio_add.lua)
-- KEYS[15] {ns}:delayed_prio:<Q> HASH payload -> priority, for one that waits in KEYS[6]
-- KEYS[16] {ns}:tries:<Q>       optional, with KEYS[17]: HASH SHA-1 of a payload -> its last
--                                failed attempts, JSON [[when_ms, worker, error], ...] oldest
--                                first, at most 5, each error cut to 1000 bytes; a first
--                                failure (the record's attempts 0) starts it anew. Mode
--                                "fail" only: nothing is written for a success or a return
-- KEYS[17] {ns}:tried:<Q>        ZSET SHA-1 of a payload -> when its last attempt failed (ms);
--                                at most 1000 members: the oldest leaves, with its KEYS[16] field
-- ARGV[1] worker id W
-- ARGV[2] mode: "return", "fail" or "keep"
-- ARGV[3] backoff base in ms (retry n waits base * 2^(n-1), capped); mode
--         "keep": how long the tasks stay reserved for W, in ms
-- ARGV[4] backoff cap in ms; a persistent task that ran longer than this
--         before failing starts its backoff again from the base
-- ARGV[5] prefix of wake channels ({ns}:wake:)
-- ARGV[6] queue name Q
-- ARGV[7..] process ids; in mode "fail" each may be followed by a NUL byte
--         and the error of that attempt (kept in a dead-letter record)
-- Returns: per process id two numbers: an outcome (0 = not W's live process,
--          nothing changed; 1 = back at the front; 2 = retry later or at the
--          back; 3 = dead-lettered) and the delay in ms before it is due.
-- Errors: BAD_ARG.
-- Times: a dead-lettered job's enqueue time goes; a retried or returned one
--        keeps it (include/enqueue_time.lua).
-- Publishes: Q on the wake channels of up to (tasks made ready now) + 1 idle
--            servers of Q (none if no task is ready now); Q on the wake
--            channel of each worker a task was reserved for.
--!include include/now_ms.lua
--!include include/int.lua
--!include include/record.lua
--!include include/fail_attempt.lua
--!include include/dead_record.lua
--!include include/count_arg.lua
--!include include/prio_add.lua
--!include include/delay_level.lua
--!include include/to_standby.lua
--!include include/nudge.lua
--!include include/wake_idle.lua
--!include include/task_weight.lua
--!include include/add_share.lua
--!include include/parse_entry.lua
--!include include/group.lua
--!include include/blob.lua
--!include include/enqueue_time_drop.lua
local groups = group_lib()
local blobs = blob_lib()

local mode = ARGV[2]
if mode ~= 'return' and mode ~= 'fail' and mode ~= 'keep' then
  return redis.error_reply('BAD_ARG mode must be "return", "fail" or "keep"')
end
local base, err = count_arg(ARGV[3], 'backoff base')
if err then return err end
local cap
cap, err = count_arg(ARGV[4], 'backoff cap')
if err then return err end

local now = now_ms()

-- Add this failure to the payload's attempt history (KEYS[16], KEYS[17]).
local function keep_try(r, at, why)
  local h = redis.sha1hex(r.payload)
  local list = {}
  if r.attempts > 0 then
    local was = redis.call('HGET', KEYS[16], h)
    if was then list = cjson.decode(was) end
  end
  list[#list + 1] = {at, r.worker, string.sub(why or '', 1, 1000)}
  while #list > 5 do table.remove(list, 1) end
  redis.call('HSET', KEYS[16], h, cjson.encode(list))
  redis.call('ZADD', KEYS[17], at, h)
  if redis.call('ZCARD', KEYS[17]) > 1000 then
    local old = redis.call('ZPOPMIN', KEYS[17])
    redis.call('HDEL', KEYS[16], old[1])
  end
end
-- A group's job (include/group.lua) goes back into its group, at the
-- front (a retry runs before the later jobs of its group), and its slot is
-- free; a retry that waits for its backoff keeps its slot until due (a
-- group without a cap counts it now: include/group.lua, group_hold_many).
local G, gfront, gfreed, gorder, gheld, ghorder = nil, {}, {}, {}, {}, {}
local function group_free(g) groups.tally(gorder, gfreed, g) end
local moving = redis.call('EXISTS', KEYS[10]) == 1
local weighted = redis.call('HEXISTS', KEYS[13], ':heavy') == 1
local out, front, pers, ready, lost = {}, {}, {}, 0, 0
local kept = false  -- a task was reserved
local buried = {}  -- the payloads dead-lettered: their enqueue times go, in one call
for i = 7, #ARGV do
  local id, why = ARGV[i], ''
  local cut = string.find(id, '\0', 1, true)
  if cut then id, why = string.sub(id, 1, cut - 1), string.sub(id, cut + 1) end
  local rec = redis.call('HGET', KEYS[1], id)
  local outcome, delay = 0, 0
  if rec then
    local r = unpack_record(rec)
    if r.worker == ARGV[1] then
      redis.call('HDEL', KEYS[1], id)
      redis.call('SREM', KEYS[2], id)
      if r.persistent then
        pers[#pers + 1] = r.payload
        if weighted then lost = lost + task_weight(KEYS[13], r.payload) - 1 end
      end
      local to = moving and redis.call('HGET', KEYS[10], id)
      if to then redis.call('HDEL', KEYS[10], id) end
      if r.group and not G then G = groups.keys_of(KEYS[1], 'procs') end
      if r.group and mode ~= 'fail' then
        gfront[#gfront + 1] = {tonumber(id), r.payload, r.group, r.level}
        group_free(r.group)
        outcome = 1
      elseif r.group then
        local where, made
        where, delay, made = fail_attempt(r, now, KEYS[5], base, cap, false)
        if KEYS[17] then keep_try(r, now, why) end
        if where == 'dead' then
          redis.call('RPUSH', KEYS[7], dead_record(now, made, r.worker, why, r.kind, r.payload))
          buried[#buried + 1] = r.payload
          group_free(r.group)
          outcome = 3
        elseif where == 'later' then
          local member = r.group .. '\0r' .. r.level .. r.payload
          blobs.merge(G.delayed, member, r.payload)
          if redis.call('ZADD', G.delayed, now + delay, member) == 1 then
            groups.tally(ghorder, gheld, r.group)
          else
            group_free(r.group)  -- a retry of the same payload waits: one slot for both
          end
          outcome = 2
        else
          gfront[#gfront + 1] = {tonumber(id), r.payload, r.group, r.level}
          group_free(r.group)
          outcome = 2
        end
      elseif mode == 'keep' and r.persistent and not to then
        -- a sticky restart: reserved for W itself for ARGV[3] ms
        redis.call('HSET', KEYS[11], r.payload, ARGV[1] .. ':' .. int(now + base))
        kept = true
        outcome = 1
      elseif mode ~= 'fail' and to and r.persistent then
        -- moved for balance: reserved for its receiver (who may have died:
        -- the reservation runs out, and the task goes to the front then)
        local w, at = parse_entry(to)
        if at > now then
          redis.call('HSET', KEYS[11], r.payload, to)
          kept = true
          nudge(ARGV[5] .. w, ARGV[6])
        else
          front[#front + 1] = {tonumber(id), r.payload, r.level}
        end
        outcome = 1
      elseif mode ~= 'fail' then
        front[#front + 1] = {tonumber(id), r.payload, r.level}
        outcome = 1
      else
        local where, made
        where, delay, made = fail_attempt(r, now, KEYS[5], base, cap, false)
        if KEYS[17] then keep_try(r, now, why) end
        if where == 'dead' then
          redis.call('RPUSH', KEYS[7], dead_record(now, made, r.worker, why, r.kind, r.payload))
          buried[#buried + 1] = r.payload
          outcome = 3
        elseif where == 'later' then
          blobs.merge(KEYS[6], r.payload, r.payload)
          redis.call('ZADD', KEYS[6], now + delay, r.payload)
          delay_level(KEYS[15], r.payload, r.level)
          outcome = 2
        elseif r.level > 0 then
          prio_add(KEYS[14], r.level, {r.payload}, false)
          ready = ready + 1
          outcome = 2
        else
          redis.call('RPUSH', KEYS[3], r.payload)
          ready = ready + 1
          outcome = 2
        end
      end
    end
  end
  out[#out + 1] = outcome
  out[#out + 1] = delay
end
enqt_drop(KEYS[1], 'procs', buried)
to_standby(KEYS[4], KEYS[8], pers, true, KEYS[12], now)
add_share(KEYS[13], 'h' .. ARGV[1], -lost)
-- a reservation is balance news: heartbeats read the share again
if kept then redis.call('HINCRBY', KEYS[13], ':gen', 1) end
-- oldest claim first at the front
table.sort(front, function(a, b) return a[1] < b[1] end)
for i = #front, 1, -1 do
  if front[i][3] > 0 then
    prio_add(KEYS[14], front[i][3], {front[i][2]}, true)
  else
    redis.call('LPUSH', KEYS[3], front[i][2])
  end
end
ready = ready + #front
wake_idle(KEYS[9], ARGV[5], ARGV[6], ready)
if G then
  -- oldest claim first at each group's front
  table.sort(gfront, function(a, b) return a[1] < b[1] end)
  local back, levels, border = {}, {}, {}
  for _, j in ipairs(gfront) do
    if not back[j[3]] then
      back[j[3]], levels[j[3]] = {}, {}
      border[#border + 1] = j[3]
    end
    table.insert(back[j[3]], j[2])
    table.insert(levels[j[3]], j[4])
  end
  for _, g in ipairs(border) do groups.push(G, g, back[g], true, levels[g]) end
  groups.release_many(G, gorder, gfreed)
  groups.hold_many(G, ghorder, gheld)
end
return out
