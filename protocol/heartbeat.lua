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
-- Returns: {now_ms, ms until the earliest lease deadline of any worker,
--           {per queue: how many servers are in its idle set},
--           {per worker: a reply}}
--          A worker's reply is the string "FENCED <reason>" if its lease
--          is gone (expired or recycled) or superseded (nothing of it was
--          written; the others of the call are renewed all the same), else
--          a flat list: k, its k inbox process ids, then per queue it named:
--          state (0 = tasks ready, -1 = none, N = ms until the earliest
--          delayed task is due), how many processes W holds there, 1 if W
--          is in its idle set else 0, then its balance: 0 when the
--          generation given is the share hash's (the caller's last balance
--          holds), otherwise 1, generation (-1 while anything of Q is moving
--          or reserved: not to be given back), T (the total weight of Q's
--          persistent tasks), C (the total capacity of its servers), W's
--          capacity, the weight of W's processes beyond one each, n, and the
--          n ids of W's processes a rebalance asked W to hand back (see
--          rebalance.lua). W's fair share is T * capacity / C (lib.lua
--          fair_share). The generation moves on with every change of the
--          share hash (lib.lua add_share), every mark (rebalance) and every
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
--!include lib.lua

-- The three counts: one match in the usual case; count_arg says which is wrong.
local ttl, m, n, err
if ARGV[3] then
  ttl, m, n = string.match(ARGV[1] .. ',' .. ARGV[2] .. ',' .. ARGV[3], '^(%d+),(%d+),(%d+)$')
end
if ttl then
  ttl, m, n = tonumber(ttl), tonumber(m), tonumber(n)
end
if not ttl or m > (#KEYS - 1) / 7 or n > 1000 then
  ttl, err = count_arg(ARGV[1], 'ttl')
  if err then return err end
  m, err = count_arg(ARGV[2], 'queue count', (#KEYS - 1) / 7)
  if err then return err end
  n, err = count_arg(ARGV[3], 'worker count', 1000)
  if err then return err end
end

-- Check every argument before the first write.
local workers = {}
local nargs, nkeys = #ARGV, #KEYS
local none = {}
local a, key = 4, 2 + 7 * m
for w = 1, n do
  local id, inc = ARGV[a], ARGV[a + 1]
  local k = tonumber(ARGV[a + 2])
  if not inc or not k or k < 0 or k ~= math.floor(k) or a + 3 + k > nargs then
    return redis.error_reply('BAD_ARG worker ' .. w .. ': bad id, incarnation or ack count')
  end
  local acks = none
  if k > 0 then
    acks = {}
    for i = 1, k do acks[i] = ARGV[a + 2 + i] end
  end
  a = a + 3 + k
  local j = tonumber(ARGV[a])
  if not j or j < 0 or j ~= math.floor(j) or a + 2 * j > nargs then
    return redis.error_reply('BAD_ARG worker ' .. w .. ': bad served queue count')
  end
  local qs, gens = {}, {}
  for i = 1, j do
    local q = tonumber(ARGV[a + 2 * i - 1])
    if not q or q < 1 or q > m or q ~= math.floor(q) then
      return redis.error_reply('BAD_ARG queue index must be from 1 to ' .. m)
    end
    qs[i], gens[i] = q, ARGV[a + 2 * i]
  end
  a = a + 1 + 2 * j
  if key + 1 + j > nkeys then return redis.error_reply('BAD_ARG too few keys') end
  workers[w] = {id = id, inc = inc, acks = acks, qs = qs, gens = gens, key = key}
  key = key + 2 + j
end

local now = now_ms()

-- Per queue, once: idle count, the share's generation, whether tasks are
-- ready, the first delayed due time.
local idles, qgen, qstate, slow = {}, {}, {}, {}
for q = 1, m do
  local b = 2 + 7 * (q - 1)
  idles[q] = redis.call('SCARD', KEYS[b + 2])
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

-- What is moving or reserved on queue q, read once, for the workers whose
-- generation is behind.
local function balance_of(q)
  local s = slow[q]
  if s then return s end
  local b = 2 + 7 * (q - 1)
  s = {moving = {}, reserved = {}, expired = false, busy = false}
  if redis.call('EXISTS', KEYS[b + 3]) == 1 then
    s.busy = true
    local all = redis.call('HGETALL', KEYS[b + 3])
    for i = 1, #all, 2 do s.moving[#s.moving + 1] = all[i] end
  end
  if redis.call('EXISTS', KEYS[b + 4]) == 1 then
    s.busy = true
    local all = redis.call('HGETALL', KEYS[b + 4])
    for i = 2, #all, 2 do
      local w, at = parse_entry(all[i])
      if at <= now then s.expired = true elseif w then s.reserved[w] = true end
    end
  end
  slow[q] = s
  return s
end

-- The leases, in one MGET; then only the live ones are written.
local leases = {}
for w = 1, n do leases[w] = KEYS[workers[w].key] end
leases = redis.call('MGET', unpack(leases))
local replies, deadlines, live, inboxes = {}, {}, {}, {}
local deadline = string.format('%.0f', now + ttl)
for w = 1, n do
  local wk = workers[w]
  if not leases[w] then
    replies[w] = 'FENCED worker ' .. wk.id .. ' has no lease (expired or recycled)'
  elseif leases[w] ~= wk.inc then
    replies[w] = 'FENCED worker ' .. wk.id .. ' lease superseded'
  else
    -- SET, not PEXPIRE: Redis refuses it when out of memory (before anything
    -- is written, as the first write of the script), so an OOM Redis fences
    -- its workers instead of keeping them alive with nothing working
    redis.call('SET', KEYS[wk.key], wk.inc, 'PX', ARGV[1])
    deadlines[#deadlines + 1] = deadline
    deadlines[#deadlines + 1] = wk.id
    live[#live + 1] = w
    inboxes[#inboxes + 1] = KEYS[wk.key + 1]
    if #wk.acks > 0 then redis.call('SREM', KEYS[wk.key + 1], unpack(wk.acks)) end
  end
end

-- Inboxes: one EXISTS for all, in the usual case (no cancel pending).
local any_inbox = #inboxes > 0 and redis.call('EXISTS', unpack(inboxes)) > 0
-- Idle sets: one SMISMEMBER per queue for all its live workers of the call.
local idle_of = {}
for q = 1, m do
  local ids = {}
  for _, w in ipairs(live) do
    for _, wq in ipairs(workers[w].qs) do
      if wq == q then ids[#ids + 1] = workers[w].id end
    end
  end
  local is = {}
  if #ids > 0 then
    local r = redis.call('SMISMEMBER', KEYS[2 + 7 * (q - 1) + 2], unpack(ids))
    for i, id in ipairs(ids) do is[id] = r[i] end
  end
  idle_of[q] = is
end

for _, w in ipairs(live) do
  local wk = workers[w]
  local out = {0}
  if any_inbox then
    local ids = redis.call('SMEMBERS', KEYS[wk.key + 1])
    out[1] = #ids
    for i = 1, #ids do out[#out + 1] = ids[i] end
  end
  for i, q in ipairs(wk.qs) do
    local held = KEYS[wk.key + 1 + i]
    if wk.gens[i] == qgen[q] then
      out[#out + 1] = qstate[q]
      out[#out + 1] = redis.call('SCARD', held)
      out[#out + 1] = idle_of[q][wk.id]
      out[#out + 1] = 0
    else
      local s = balance_of(q)
      local p, sv, cap, extra = fair_share(KEYS[2 + 7 * (q - 1) + 5], wk.id)
      out[#out + 1] = (s.expired or s.reserved[wk.id]) and 0 or qstate[q]
      out[#out + 1] = redis.call('SCARD', held)
      out[#out + 1] = idle_of[q][wk.id]
      local mine = {}
      for _, pid in ipairs(s.moving) do
        if redis.call('SISMEMBER', held, pid) == 1 then mine[#mine + 1] = pid end
      end
      for _, x in ipairs({1, s.busy and -1 or tonumber(qgen[q]), p, sv, cap, extra, #mine}) do
        out[#out + 1] = x
      end
      for _, pid in ipairs(mine) do out[#out + 1] = pid end
    end
  end
  replies[w] = out
end
for i = 1, #deadlines, 200 do
  redis.call('ZADD', KEYS[1], unpack(deadlines, i, math.min(i + 199, #deadlines)))
end

local earliest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local next_ms = -1
if #earliest > 0 then next_ms = tonumber(earliest[2]) - now end
return {now, next_ms, idles, replies}
