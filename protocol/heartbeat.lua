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
-- their new deadlines (ZADD), whether any has a cancel in its inbox or holds
-- anything (one EXISTS of every inbox and held set) and their idle-set
-- memberships (SMISMEMBER per queue, none when the idle set is empty). What
-- is left per worker: the PEXPIRE of its lease, and an SCARD per served
-- queue only when some worker of the call holds something; the balance where
-- the queue's generation moved since the worker last saw it. No table per
-- worker; the counts of the usual case ("0" acks, "1" queue, index "1") are
-- compared as strings, not converted; the TTL and the deadline go to Redis
-- as strings made once per call (a Lua number given to redis.call is
-- formatted with snprintf at each call: it cost more than the PEXPIRE).
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

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)  -- include/now_ms.lua
-- Strings, made once: a number given to redis.call is formatted at each call.
local ttl_s, deadline = ARGV[1], string.format('%d', now + ttl)
if not string.find(ttl_s, '^[1-9]%d*$') then ttl_s = string.format('%d', ttl) end

-- The reply, flat (each table of a reply costs Redis more than a few
-- elements do): now, ms until the earliest deadline (filled in last), the
-- idle counts, then each worker's part.
local res = {now, -1}

-- Per queue, once (reads only: nothing is written before every argument is
-- checked): idle count, the share's generation, whether tasks are ready,
-- the first delayed due time.
local qgen, qstate, slow = {}, {}, false
for q = 1, m do
  local b = 2 + 7 * (q - 1)
  res[q + 2] = redis.call('SCARD', KEYS[b + 2])
  qgen[q] = redis.call('HGET', KEYS[b + 5], ':gen') or '0'
  local state = -1
  if redis.call('EXISTS', KEYS[b], KEYS[b + 6]) > 0 then
    state = 0
  else
    local first = redis.call('ZRANGE', KEYS[b + 1], '0', '0', 'WITHSCORES')
    if #first > 0 then state = math.max(0, tonumber(first[2]) - now) end
  end
  qstate[q] = state
end

-- Check every argument before the first write, and collect what is read
-- for all the call's workers with one command each: lk, their leases;
-- ids[q], the workers that serve queue q, in order, where q's idle set is not
-- empty (their inboxes and held sets are read where they are, in KEYS). (Each Lua operation per worker
-- costs Redis about as much as a command's argument: the workers' arguments
-- are walked twice, here and when written, and nothing is kept per worker.)
local nargs, nkeys = #ARGV, #KEYS
local lk, ids = {}, {}
local a, key = 4, 2 + 7 * m
for w = 1, n do
  local inc, k = ARGV[a + 1], ARGV[a + 2]
  if k == '0' and inc then
    k = 0
  else
    k = k and tonumber(k)
  end
  if not inc or not k or k < 0 or k % 1 ~= 0 or a + 3 + k > nargs then
    return redis.error_reply('BAD_ARG worker ' .. w .. ': bad id, incarnation or ack count')
  end
  local id = ARGV[a]
  a = a + 3 + k
  local j = ARGV[a]
  if j == '1' then j = 1 else j = tonumber(j) end
  if not j or j < 0 or j % 1 ~= 0 or a + 2 * j > nargs then
    return redis.error_reply('BAD_ARG worker ' .. w .. ': bad served queue count')
  end
  if key + 1 + j > nkeys then return redis.error_reply('BAD_ARG too few keys') end
  lk[w] = KEYS[key]
  for i = 1, j do
    local q = ARGV[a + 2 * i - 1]
    if q == '1' and m >= 1 then q = 1 else q = tonumber(q) end
    if not q or q < 1 or q > m or q % 1 ~= 0 then
      return redis.error_reply('BAD_ARG queue index must be from 1 to ' .. m)
    end
    if res[q + 2] > 0 then
      local l = ids[q]
      if not l then l = {}; ids[q] = l end
      l[#l + 1] = id
    end
  end
  a = a + 1 + 2 * j
  key = key + 2 + j
end

-- The leases: one MGET (a GET for one worker). Inboxes and held sets: one
-- EXISTS for all (per 1,000 keys; the call's worker keys as they are in
-- KEYS, leases included, whose count the MGET gives); in the usual case of
-- an idle fleet none exists, and nothing more is read of them. Idle sets: one SMISMEMBER per
-- queue (SISMEMBER for one worker), none where the set is empty; idle[q]
-- holds the answers in order, at[q] counts those used. These reads take in
-- the workers that turn out to be fenced (they are not written, and their
-- answers are skipped).
local leases
if n == 1 then
  leases = {redis.call('GET', lk[1])}
elseif n == 0 then
  leases = {}
else
  leases = redis.call('MGET', unpack(lk))
end
local found = 0
for w = 1, n do
  if leases[w] then found = found - 1 end
end
for i = 2 + 7 * m, key - 1, 1000 do
  found = found + redis.call('EXISTS', unpack(KEYS, i, math.min(i + 999, key - 1)))
end
local idle, at = {}, {}
for q, l in pairs(ids) do
  if #l == 1 then
    idle[q] = {redis.call('SISMEMBER', KEYS[2 + 7 * (q - 1) + 2], l[1])}
  else
    idle[q] = redis.call('SMISMEMBER', KEYS[2 + 7 * (q - 1) + 2], unpack(l))
  end
  at[q] = 0
end
-- Held counts: with something held or in an inbox, an SCARD per held set of
-- the live workers (held[x], x counting every worker's queues in order);
-- the inboxes are those of the existing keys the held sets do not account
-- for (a fenced worker's count as inboxes: then every inbox is read).
local held, any_inbox = false, false
if found > 0 then
  held = {}
  local nheld, x = 0, 0
  a, key = 4, 2 + 7 * m
  for w = 1, n do
    local k = ARGV[a + 2]
    k = k == '0' and 0 or tonumber(k)
    local j = ARGV[a + 3 + k]
    j = j == '1' and 1 or tonumber(j)
    if leases[w] == ARGV[a + 1] then
      for i = 1, j do
        local c = redis.call('SCARD', KEYS[key + 1 + i])
        held[x + i] = c
        if c > 0 then nheld = nheld + 1 end
      end
    end
    x = x + j
    a = a + 4 + k + 2 * j
    key = key + 2 + j
  end
  any_inbox = found > nheld
end

-- Write and answer, worker by worker. z: the ZADD's score/member pairs.
local z, nz, r, x = {}, 0, m + 2, 0
a, key = 4, 2 + 7 * m
for w = 1, n do
  local id, k = ARGV[a], ARGV[a + 2]
  k = k == '0' and 0 or tonumber(k)
  local jw = a + 3 + k
  local j = ARGV[jw]
  j = j == '1' and 1 or tonumber(j)
  local lease = leases[w]
  if lease and lease == ARGV[a + 1] then
    -- PEXPIRE, not SET: Redis does not refuse it at the memory limit (it is
    -- not "denyoom"), and as the first write of the script it lets the
    -- renewal through, so a full Redis does not fence live workers (see "At
    -- the memory limit" in README.md); the value was checked just above
    redis.call('PEXPIRE', KEYS[key], ttl_s)
    z[nz + 1], z[nz + 2] = deadline, id
    nz = nz + 2
    if k > 0 then redis.call('SREM', KEYS[key + 1], unpack(ARGV, a + 3, a + 2 + k)) end
    local nin = 0
    if any_inbox then
      local inbox = redis.call('SMEMBERS', KEYS[key + 1])
      nin = #inbox
      for i = 1, nin do res[r + 1 + i] = inbox[i] end
    end
    res[r + 1] = nin
    r = r + 1 + nin
    for i = 1, j do
      local q = ARGV[jw + 2 * i - 1]
      if q == '1' then q = 1 else q = tonumber(q) end
      local in_idle, l = 0, idle[q]
      if l then
        local y = at[q] + 1
        at[q], in_idle = y, l[y]
      end
      local h = held and held[x + i] or 0
      if ARGV[jw + 2 * i] == qgen[q] then
        res[r + 1], res[r + 2], res[r + 3], res[r + 4] = qstate[q], h, in_idle, 0
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
            for y = 1, #all, 2 do s.moving[#s.moving + 1] = all[y] end
          end
          if redis.call('EXISTS', KEYS[b + 4]) == 1 then
            s.busy = true
            local all = redis.call('HGETALL', KEYS[b + 4])
            for y = 2, #all, 2 do
              local ew, wat = parse_entry(all[y])
              if wat <= now then s.expired = true elseif ew then s.reserved[ew] = true end
            end
          end
          slow[q] = s
        end
        local sh, sv, cap, extra = fair_share(KEYS[2 + 7 * (q - 1) + 5], id)
        res[r + 1] = (s.expired or s.reserved[id]) and 0 or qstate[q]
        res[r + 2] = h
        res[r + 3] = in_idle
        local mine = {}
        if h > 0 then
          local heldkey = KEYS[key + 1 + i]
          for _, pid in ipairs(s.moving) do
            if redis.call('SISMEMBER', heldkey, pid) == 1 then mine[#mine + 1] = pid end
          end
        end
        res[r + 4] = 1
        res[r + 5] = s.busy and -1 or tonumber(qgen[q])
        res[r + 6], res[r + 7], res[r + 8], res[r + 9] = sh, sv, cap, extra
        res[r + 10] = #mine
        r = r + 10
        for y = 1, #mine do res[r + y] = mine[y] end
        r = r + #mine
      end
    end
  else
    r = r + 1
    if not lease then
      res[r] = 'FENCED worker ' .. id .. ' has no lease (expired or recycled)'
    else
      res[r] = 'FENCED worker ' .. id .. ' lease superseded'
    end
    -- its answers from the idle sets are skipped
    for i = 1, j do
      local q = ARGV[jw + 2 * i - 1]
      if q == '1' then q = 1 else q = tonumber(q) end
      if idle[q] then at[q] = at[q] + 1 end
    end
  end
  x = x + j
  a = jw + 1 + 2 * j
  key = key + 2 + j
end

-- The deadlines: one ZADD (per 200 workers), after the first PEXPIRE (a
-- ZADD is refused at the memory limit unless the script has written).
for i = 1, nz, 400 do
  redis.call('ZADD', KEYS[1], unpack(z, i, math.min(i + 399, nz)))
end

local earliest = redis.call('ZRANGE', KEYS[1], '0', '0', 'WITHSCORES')
if #earliest > 0 then res[2] = tonumber(earliest[2]) - now end
return res
