-- heartbeat.lua: renew the leases of one or more workers (a fleet's workers
-- share one call: see mesh/_fleet.py); for each, collect its durable
-- cancels, say which of its queues have work and how many processes Redis
-- says it holds there, whether it is in each queue's idle set, and its
-- balance (fair share, what a rebalance asks it to hand back); say when the
-- next peer lease runs out.
--
-- What depends only on a queue (ready tasks, the first delayed due time, the
-- idle count, the share hash's generation, what is moving or reserved) is
-- read once per call, however many of the call's workers serve the queue; so
-- are, with one command for all the call's workers, their leases (MGET),
-- whether any has a cancel in its inbox (EXISTS), their idle-set memberships
-- (SMISMEMBER, per queue) and their new deadlines (ZADD). What is left per
-- worker: a SET (the lease), an SCARD (held) per served queue, and the
-- balance where the queue's generation moved since the worker last saw it.
-- A call for one worker (a worker without a fleet, or a fleet of one) makes
-- no tables it does not need: GET, EXISTS, ZADD and SISMEMBER with its keys
-- as they are (a Lua table costs about as much as a small command).
--
-- KEYS[1]  {ns}:workers   ZSET lease deadlines
-- KEYS[2 + 7i] .. KEYS[8 + 7i] for each queue i = 0..m-1 named by the call:
--          {ns}:queue:<Q>, {ns}:delayed:<Q>, {ns}:idle:<Q>, {ns}:moving:<Q>,
--          {ns}:reserved:<Q>, {ns}:share:<Q>, {ns}:prio:<Q> (tasks with a
--          priority count as ready)
-- then for each worker W, in ARGV's order: {ns}:worker:<W> (heartbeat key),
--          {ns}:inbox:<W>, and {ns}:held:<W>:<Q> for each queue W names
-- ARGV[1]  ttl in ms (the same for every worker of the call)
-- ARGV[2]  m, how many queues
-- ARGV[3]  n, how many workers (1..1000)
-- then for each worker: its id W, its incarnation, k and the k process ids
--          of acknowledged cancels, j, and for each of the j queues W serves
--          its 1-based index into the m queues and the generation of its
--          share hash (field ':gen') W last saw with nothing moving or
--          reserved ("": none)
-- Returns: one flat list (a table in a reply costs Redis more than a few
--          elements do): now_ms, ms until the earliest lease deadline of
--          any worker (-1: none), then per queue i = 1..m how many servers
--          are in its idle set, then each worker's part, in ARGV's order,
--          one after the other (the caller knows each part's length from
--          its counts).
--          A worker's part is the one string "FENCED <reason>" if its lease
--          is gone (expired or recycled) or superseded (nothing of it was
--          written; the others of the call are renewed all the same), else
--          k, its k inbox process ids, then per queue it named:
--          state (0 = tasks ready, -1 = none, N = ms until the earliest
--          delayed task is due), how many processes W holds there, 1 if W
--          is in its idle set else 0, then its balance: 0 when the
--          generation given is the share hash's (the caller's last balance
--          holds), otherwise 1, generation (-1 while anything of Q is moving
--          or reserved: not to be given back), T (the total weight of Q's
--          persistent tasks), C (the total capacity of its servers), W's
--          capacity, the weight of W's processes beyond one each, n, and the
--          n ids of W's processes a rebalance asked W to hand back (see
--          rebalance.lua). W's fair share is T * capacity / C (include/fair_share.lua
--          ). The generation moves on with every change of the
--          share hash (include/add_share.lua), every mark (rebalance) and every
--          reservation (give_back).
--          A queue with a task reserved for W, or a reservation that ran
--          out, counts as having tasks ready (state 0).
--          A worker that runs more processes of a queue than Redis says it
--          holds must find out which are gone (they were lost, e.g. by a
--          failover that dropped writes) and stop them. A worker with a
--          free slot on a queue, not held back by the fair share, that is
--          not in its idle set claims: nobody would wake it (its wake was
--          lost). Every idle server learns when a delayed task is due; the
--          idle count lets about three of them act on it, not all.
-- Errors: BAD_ARG (the whole call: nothing is written).
-- Publishes: nothing.
--!include include/count_arg.lua
--!include include/fair_share.lua
--!include include/parse_entry.lua

-- The three counts: whole numbers in range in the usual case (x % 1 is not
-- 0 for a fraction, inf or nan); count_arg says which is wrong.
local ttl, m, n, err = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), nil
if not (ttl and m and n) or ttl % 1 ~= 0 or m % 1 ~= 0 or n % 1 ~= 0 or ttl < 0 or m < 0
    or n < 0 then
  ttl = nil
end
if not ttl or m > (#KEYS - 1) / 7 or n > 1000 then
  ttl, err = count_arg(ARGV[1], 'ttl')
  if err then return err end
  m, err = count_arg(ARGV[2], 'queue count', (#KEYS - 1) / 7)
  if err then return err end
  n, err = count_arg(ARGV[3], 'worker count', 1000)
  if err then return err end
end

-- Check every argument before the first write. A worker's acks and the
-- generations it gives are read from ARGV where they are (at ARGV[ack + i]
-- and ARGV[gen + 2 * i]): fewer tables to build.
local workers = {}
local nargs, nkeys = #ARGV, #KEYS
local a, key = 4, 2 + 7 * m
for w = 1, n do
  local id, inc = ARGV[a], ARGV[a + 1]
  local k = tonumber(ARGV[a + 2])
  if not inc or not k or k < 0 or k % 1 ~= 0 or a + 3 + k > nargs then
    return redis.error_reply('BAD_ARG worker ' .. w .. ': bad id, incarnation or ack count')
  end
  local ack = a + 2
  a = a + 3 + k
  local j = tonumber(ARGV[a])
  if not j or j < 0 or j % 1 ~= 0 or a + 2 * j > nargs then
    return redis.error_reply('BAD_ARG worker ' .. w .. ': bad served queue count')
  end
  local qs = {}
  for i = 1, j do
    local q = tonumber(ARGV[a + 2 * i - 1])
    if not q or q < 1 or q > m or q % 1 ~= 0 then
      return redis.error_reply('BAD_ARG queue index must be from 1 to ' .. m)
    end
    qs[i] = q
  end
  if key + 1 + j > nkeys then return redis.error_reply('BAD_ARG too few keys') end
  workers[w] = {id = id, inc = inc, k = k, ack = ack, qs = qs, gen = a, key = key}
  a = a + 1 + 2 * j
  key = key + 2 + j
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)  -- include/now_ms.lua

-- The reply, flat (each table of a reply costs Redis more than a few
-- elements do): now, ms until the earliest deadline (filled in last), the
-- idle counts, then each worker's part.
local res = {now, -1}

-- Per queue, once: idle count, the share's generation, whether tasks are
-- ready, the first delayed due time.
local qgen, qstate, slow = {}, {}, false
for q = 1, m do
  local b = 2 + 7 * (q - 1)
  res[q + 2] = redis.call('SCARD', KEYS[b + 2])
  qgen[q] = redis.call('HGET', KEYS[b + 5], ':gen') or '0'
  local state = -1
  if redis.call('EXISTS', KEYS[b], KEYS[b + 6]) > 0 then
    state = 0
  else
    local first = redis.call('ZRANGE', KEYS[b + 1], 0, 0, 'WITHSCORES')
    if #first > 0 then state = math.max(0, tonumber(first[2]) - now) end
  end
  qstate[q] = state
end

-- The leases, in one MGET (a GET for one worker); then only the live ones
-- are written. With one worker, no tables: its deadline and inbox are used
-- as they are. fenced[w]: the reply of a fenced worker (false: none is).
local leases
if n == 1 then
  leases = redis.call('GET', KEYS[workers[1].key])
else
  leases = {}
  for w = 1, n do leases[w] = KEYS[workers[w].key] end
  leases = redis.call('MGET', unpack(leases))
end
local fenced, deadlines, inboxes, nlive = false, false, false, 0
if n > 1 then deadlines, inboxes = {}, {} end
-- A number, not a string: Redis writes it in full for ZADD.
local deadline = now + ttl
for w = 1, n do
  local wk = workers[w]
  local lease
  if n == 1 then lease = leases else lease = leases[w] end
  if not lease then
    fenced = fenced or {}
    fenced[w] = 'FENCED worker ' .. wk.id .. ' has no lease (expired or recycled)'
  elseif lease ~= wk.inc then
    fenced = fenced or {}
    fenced[w] = 'FENCED worker ' .. wk.id .. ' lease superseded'
  else
    -- PEXPIRE, not SET: Redis does not refuse it at the memory limit (it is
    -- not "denyoom"), and as the first write of the script it lets the
    -- renewal through, so a full Redis does not fence live workers (see "At
    -- the memory limit" in README.md); the value was checked just above
    redis.call('PEXPIRE', KEYS[wk.key], ttl)
    nlive = nlive + 1
    if deadlines then
      deadlines[#deadlines + 1] = deadline
      deadlines[#deadlines + 1] = wk.id
      inboxes[#inboxes + 1] = KEYS[wk.key + 1]
    end
    if wk.k > 0 then redis.call('SREM', KEYS[wk.key + 1], unpack(ARGV, wk.ack + 1, wk.ack + wk.k)) end
  end
end

-- The deadlines: one ZADD (per 200 workers). Inboxes: one EXISTS for all,
-- in the usual case (no cancel pending).
local any_inbox = false
if not deadlines then
  if nlive == 1 then
    redis.call('ZADD', KEYS[1], deadline, workers[1].id)
    any_inbox = redis.call('EXISTS', KEYS[workers[1].key + 1]) > 0
  end
else
  for i = 1, #deadlines, 200 do
    redis.call('ZADD', KEYS[1], unpack(deadlines, i, math.min(i + 199, #deadlines)))
  end
  any_inbox = #inboxes > 0 and redis.call('EXISTS', unpack(inboxes)) > 0
end
-- Idle sets: one SMISMEMBER per queue for all its live workers of the call
-- (with one live worker, a SISMEMBER per queue as its reply is written: no
-- tables to build).
local idle_of = false
if nlive > 1 then
  idle_of = {}
  for q = 1, m do
    local ids = {}
    for w = 1, n do
      if not (fenced and fenced[w]) then
        for _, wq in ipairs(workers[w].qs) do
          if wq == q then ids[#ids + 1] = workers[w].id end
        end
      end
    end
    local is = {}
    if #ids > 0 then
      local r = redis.call('SMISMEMBER', KEYS[2 + 7 * (q - 1) + 2], unpack(ids))
      for i, id in ipairs(ids) do is[id] = r[i] end
    end
    idle_of[q] = is
  end
end

local r = m + 2
for w = 1, n do
  local wk = workers[w]
  if fenced and fenced[w] then
    r = r + 1
    res[r] = fenced[w]
  else
    local nin = 0
    if any_inbox then
      local ids = redis.call('SMEMBERS', KEYS[wk.key + 1])
      nin = #ids
      for i = 1, nin do res[r + 1 + i] = ids[i] end
    end
    res[r + 1] = nin
    r = r + 1 + nin
    local qs, gen = wk.qs, wk.gen
    for i = 1, #qs do
      local q = qs[i]
      local held = KEYS[wk.key + 1 + i]
      if ARGV[gen + 2 * i] == qgen[q] then
        res[r + 1] = qstate[q]
        res[r + 2] = redis.call('SCARD', held)
        res[r + 3] = idle_of and idle_of[q][wk.id]
          or redis.call('SISMEMBER', KEYS[2 + 7 * (q - 1) + 2], wk.id)
        res[r + 4] = 0
        r = r + 4
      else
        -- what is moving or reserved on Q, read once for the workers whose
        -- generation is behind
        slow = slow or {}
        local s = slow[q]
        if not s then
          local b = 2 + 7 * (q - 1)
          s = {moving = {}, reserved = {}, expired = false, busy = false}
          if redis.call('EXISTS', KEYS[b + 3]) == 1 then
            s.busy = true
            local all = redis.call('HGETALL', KEYS[b + 3])
            for x = 1, #all, 2 do s.moving[#s.moving + 1] = all[x] end
          end
          if redis.call('EXISTS', KEYS[b + 4]) == 1 then
            s.busy = true
            local all = redis.call('HGETALL', KEYS[b + 4])
            for x = 2, #all, 2 do
              local ew, at = parse_entry(all[x])
              if at <= now then s.expired = true elseif ew then s.reserved[ew] = true end
            end
          end
          slow[q] = s
        end
        local p, sv, cap, extra = fair_share(KEYS[2 + 7 * (q - 1) + 5], wk.id)
        res[r + 1] = (s.expired or s.reserved[wk.id]) and 0 or qstate[q]
        res[r + 2] = redis.call('SCARD', held)
        res[r + 3] = idle_of and idle_of[q][wk.id]
          or redis.call('SISMEMBER', KEYS[2 + 7 * (q - 1) + 2], wk.id)
        local mine = {}
        for _, pid in ipairs(s.moving) do
          if redis.call('SISMEMBER', held, pid) == 1 then mine[#mine + 1] = pid end
        end
        res[r + 4] = 1
        res[r + 5] = s.busy and -1 or tonumber(qgen[q])
        res[r + 6], res[r + 7], res[r + 8], res[r + 9] = p, sv, cap, extra
        res[r + 10] = #mine
        r = r + 10
        for x = 1, #mine do res[r + x] = mine[x] end
        r = r + #mine
      end
    end
  end
end

local earliest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #earliest > 0 then res[2] = tonumber(earliest[2]) - now end
return res
