-- lib.lua: helpers shared by the scripts. Not a script of its own: a loader
-- splices this file where a script has the line `--!include lib.lua`.
--
-- Process record (the value of a field of {ns}:procs:<Q>, the field being the
-- process id; written by claim.lua, read by unpack_record and record_head):
-- nine fields joined by NUL bytes, the payload last so that it may contain
-- NUL bytes itself:
--   worker \0 kind \0 attempts \0 max_attempts \0 backoff_ms \0 backoff_cap_ms
--   \0 ttl_ms \0 started_ms \0 payload
-- kind is "p" (persistent), "o" (one-shot) or "o1".."o9" (one-shot with that
-- priority: it goes back to its level when returned or retried); attempts is how many earlier
-- attempts of this payload failed; max_attempts 0 means no limit; the
-- backoff and lease ttl are the claiming worker's, applied when a peer
-- recycles the process.

-- Whole milliseconds from the Redis clock (the only clock that judges).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Whole microseconds from the Redis clock (two scripts never share one).
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Both from one TIME call (each call costs about as much as a small command).
local function now_ms_us()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us
end

-- Integers as plain decimal strings (tostring() turns 1e15 into "1e+15").
local function int(n)
  return string.format('%.0f', n)
end

-- The `k` process ids first, first + 1, .. as decimal strings, as int()
-- writes them, with one string.format in the usual case instead of one per id
-- (string.format is the dearest thing Lua does per claimed task): the last
-- two digits are cut out of a constant. Ids are whole numbers below 2^53.
local function id_strings(first, k)
  local digits = '00010203040506070809101112131415161718192021222324252627282930313233343536373839404142434445464748495051525354555657585960616263646566676869707172737475767778798081828384858687888990919293949596979899'
  local out = {}
  -- string.format as int() does, not int(): a script calling this one
  -- then need not make int()'s closure at every call
  local head, low = string.format('%.0f', math.floor(first / 100)), first % 100
  for i = 1, k do
    if low == 100 then
      head, low = string.format('%.0f', math.floor((first + i - 1) / 100)), 0
    end
    if head == '0' then
      out[i] = string.format('%.0f', low)
    else
      out[i] = head .. string.sub(digits, 2 * low + 1, 2 * low + 2)
    end
    low = low + 1
  end
  return out
end

-- The fields of a process record (see the top of this file) that finishing
-- it needs, if it is a record of `worker` (false otherwise): kind, attempts
-- (a decimal string) and payload. One prefix compare and one match, not a
-- table of all nine fields as unpack_record builds. `wz` is worker .. '\0'.
local function record_head(rec, wz)
  if string.sub(rec, 1, #wz) ~= wz then return false end
  return string.match(rec, '^([^%z]*)%z(%d+)%z%d*%z%d*%z%d*%z%d*%z%d*%z(.*)$', #wz + 1)
end

-- tonumber(s), remembered in `nums` (a table the caller keeps for one
-- script call): records of one worker share most of their numbers, and
-- converting a string costs Redis ~1k instructions (strtod) where a table
-- lookup costs a few.
local function cached_number(nums, s)
  local v = nums[s]
  if v == nil then
    v = tonumber(s) or false
    nums[s] = v
  end
  return v or nil
end

-- Every field of a process record (see the top of this file), one match;
-- with `nums` (see cached_number), its numbers converted once per call.
local function unpack_record(rec, nums)
  local w, kind, a, ma, b, bc, ttl, st, payload = string.match(rec,
    '^([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z(.*)$')
  nums = nums or {}
  return {
    worker = w,
    persistent = (kind == 'p'),
    level = #kind > 1 and tonumber(string.sub(kind, 2)) or 0,
    attempts = cached_number(nums, a),
    max_attempts = cached_number(nums, ma),
    backoff = cached_number(nums, b),
    backoff_cap = cached_number(nums, bc),
    ttl = cached_number(nums, ttl),
    started = cached_number(nums, st),
    payload = payload,
  }
end

-- Whether `payload` is a persistent task of a queue: queued or delayed (a
-- member of its standby set, or a field of its persistent hash with the
-- value "": see to_standby) or running (a field of the hash, with the id of
-- the process that runs it).
local function is_persistent(running, standby, payload)
  return redis.call('SISMEMBER', standby, payload) == 1
    or redis.call('HEXISTS', running, payload) == 1
end

-- A failed attempt of the process `r` (a record) whose payload had `prev`
-- failed attempts before: the count to keep (false: forget it), and where
-- the task goes: 'dead' (a one-shot task at its attempt limit), 'front' (a
-- crash-recycled task's first failure: failover at once), 'later' (after
-- `delay` ms: base * 2^(n-1), capped) or 'back' (no backoff). A persistent
-- task that ran longer than the cap before failing starts counting again;
-- so does one whose worker crashed after it had run for at least one lease
-- ttl (a crash is recycled at least ttl after it happened): a task that
-- kills its worker does so at once, a healthy one was merely unlucky.
local function next_attempt(r, now, prev, base, cap, first_at_front)
  local a
  local ran = now - r.started
  if first_at_front then ran = ran - r.ttl end
  if r.persistent and (ran > cap or (first_at_front and r.ttl > 0 and ran >= r.ttl)) then
    a = 1
  else
    a = prev + 1
  end
  if not r.persistent and r.max_attempts > 0 and a >= r.max_attempts then
    return false, 'dead', 0, a
  end
  local n = a
  if first_at_front then
    if a == 1 then return a, 'front', 0 end
    n = a - 1
  end
  local delay = math.floor(math.min(base * 2 ^ (n - 1), cap))
  if delay > 0 then return a, 'later', delay end
  return a, 'back', 0
end

-- next_attempt for one process, with its count read from and written to the
-- hash `attempts`; returns where, delay, and for 'dead' the attempts made.
local function fail_attempt(r, now, attempts, base, cap, first_at_front)
  local prev = tonumber(redis.call('HGET', attempts, r.payload) or '0')
  local a, where, delay, made = next_attempt(r, now, prev, base, cap, first_at_front)
  if a then
    redis.call('HSET', attempts, r.payload, a)
  else
    redis.call('HDEL', attempts, r.payload)
  end
  return where, delay, made
end

-- An entry of a dead-letter list ({ns}:dead:<Q>): five fields joined by NUL
-- bytes, the payload last (it may contain NUL bytes):
--   when_ms \0 attempts \0 worker \0 error \0 payload
-- `err` (the last failure) is cut to 2000 bytes and its NUL bytes become
-- spaces.
local function dead_record(now, attempts, worker, err, payload)
  err = string.gsub(string.sub(err or '', 1, 2000), '%z', ' ')
  return int(now) .. '\0' .. int(attempts) .. '\0' .. worker .. '\0' .. err .. '\0' .. payload
end

-- nil if `worker` holds the lease stored at `key` under `incarnation`, else an
-- error reply to return at once (before any write).
local function lease_error(key, worker, incarnation)
  local v = redis.call('GET', key)
  if not v then
    return redis.error_reply('FENCED worker ' .. worker .. ' has no lease (expired or recycled)')
  end
  if v ~= incarnation then
    return redis.error_reply('FENCED worker ' .. worker .. ' lease superseded')
  end
  return nil
end

local function count_arg(v, name, max)
  local n = tonumber(v)
  if not n or n < 0 or n ~= math.floor(n) or (max and n > max) then
    return nil, redis.error_reply('BAD_ARG ' .. name .. ' must be a whole number'
      .. (max and (' from 0 to ' .. max) or ' >= 0'))
  end
  return n, nil
end

-- Process ids in claim order (ids are tokens, increasing with claim time).
-- Decimal strings without leading zeros of one length sort as numbers do,
-- and a plain sort of strings is much cheaper in Lua than a comparator.
local function sorted_ids(ids)
  local len = ids[1] and #ids[1]
  for i = 2, #ids do
    if #ids[i] ~= len then
      table.sort(ids, function(a, b) return tonumber(a) < tonumber(b) end)
      return ids
    end
  end
  table.sort(ids)
  return ids
end

-- redis.call(cmd, key, <head...>, items...) in chunks (Lua's unpack() has a
-- limit on the number of values); does nothing when `items` is empty.
local function call_chunked(cmd, key, items, step)
  step = step or 1
  local chunk = 1000 * step
  for i = 1, #items, chunk do
    redis.call(cmd, key, unpack(items, i, math.min(i + chunk - 1, #items)))
  end
end

-- HMGET of every field in `fields` (chunked like call_chunked): the values,
-- false for a missing one, in the order of `fields`.
local function hmget_all(key, fields)
  local out = {}
  for i = 1, #fields, 1000 do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(i + 999, #fields)))
    for j = 1, #part do out[i + j - 1] = part[j] end
  end
  return out
end

-- Priorities. A one-shot task with a priority of 1..9 waits in
-- {ns}:prio:<Q>, a ZSET scored -priority whose members are the priority (one
-- digit), a 15-digit order number and the payload: ZPOPMIN takes the highest
-- priority first and, within one, the lowest order number (members of one
-- score sort as strings, and the numbers have one width): FIFO within a
-- level. The digit keeps copies of a payload at two levels apart. Priority 0
-- is the queue's list. Adds `payloads` at the back of `level`, in order, or
-- with `front` at its front (payloads[1] first). O(log n) per task.
local function prio_add(prio, level, payloads, front)
  if #payloads == 0 then return end
  local s = -level
  local edge
  if front then
    edge = redis.call('ZRANGEBYSCORE', prio, s, s, 'LIMIT', 0, 1)
  else
    edge = redis.call('ZREVRANGEBYSCORE', prio, s, s, 'LIMIT', 0, 1)
  end
  local seq = 5e14
  if #edge > 0 then
    seq = tonumber(string.sub(edge[1], 2, 16))
    if front then seq = seq - #payloads else seq = seq + 1 end
  end
  local args = {}
  for i, p in ipairs(payloads) do
    args[#args + 1] = s
    args[#args + 1] = level .. string.format('%015.0f', seq + i - 1) .. p
  end
  call_chunked('ZADD', prio, args, 2)
end

-- Remove every copy of `payload` from a {ns}:prio:<Q> set (see prio_add);
-- returns how many. O(prioritized tasks queued).
local function prio_remove(prio, payload)
  local n = 0
  for _, m in ipairs(redis.call('ZRANGE', prio, 0, -1)) do
    if string.sub(m, 17) == payload then n = n + redis.call('ZREM', prio, m) end
  end
  return n
end

-- A payload entering a delayed set with a priority: its level is kept in
-- {ns}:delayed_prio:<Q> (payload -> level; the higher one when a delayed
-- payload is delayed again, as the two share one entry) until it is due.
local function delay_level(dprio, payload, level)
  if level > 0 then
    local cur = tonumber(redis.call('HGET', dprio, payload) or '0')
    if level > cur then redis.call('HSET', dprio, payload, level) end
  end
end

-- Keep persistent tasks (payloads) as queued or delayed. Where depends on
-- what costs Redis less memory, never on meaning (a queued persistent task
-- is a member of `standby` or a field of `persistent` with the value ""):
-- a hash of at most 128 fields of at most 64 bytes is compact (a listpack,
-- a ziplist before Redis 7: the defaults of hash-max-listpack-entries and
-- -value), a few bytes per entry, and a set of strings is not before Redis
-- 7.2; a bigger hash is a hash table, which spends an 8-byte value string on
-- each entry that a set does not. So a payload stays in the hash (value "")
-- while the hash is compact and stays so, and goes to the set otherwise.
-- `running`: the payloads are fields of `persistent` now (they stop running).
-- Each payload is also recorded in `unowned` (ZSET payload -> ms), the Redis
-- time since when no process runs it; claim.lua removes it when one does.
local function to_standby(persistent, standby, payloads, running, unowned, now)
  if #payloads == 0 then return end
  local since = {}
  local at = int(now)  -- converted once, not once per payload
  for _, p in ipairs(payloads) do
    since[#since + 1] = at
    since[#since + 1] = p
  end
  call_chunked('ZADD', unowned, since, 2)
  local compact = redis.call('OBJECT', 'ENCODING', persistent) ~= 'hashtable'
  local size = redis.call('HLEN', persistent)
  local in_hash, in_set, gone = {}, {}, {}
  for _, p in ipairs(payloads) do
    if compact and #p <= 64 and (running or size < 128) then
      in_hash[#in_hash + 1] = p
      in_hash[#in_hash + 1] = ''
      if not running then size = size + 1 end
    else
      in_set[#in_set + 1] = p
      if running then gone[#gone + 1] = p end
    end
  end
  call_chunked('HDEL', persistent, gone)
  call_chunked('HSET', persistent, in_hash, 2)
  call_chunked('SADD', standby, in_set)
end

-- Whether a payload popped from a queue is a persistent task (see
-- to_standby).
local function is_queued_persistent(persistent, standby, payload)
  local v = redis.call('HGET', persistent, payload)
  if v then return v == '' end
  return redis.call('SISMEMBER', standby, payload) == 1
end

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
    if where == 'dead' then
      buried[#buried + 1] = dead_record(now, made, r.worker,
        'worker crashed: the lease of worker ' .. r.worker .. ' expired', r.payload)
      told[#told + 1] = {string.sub(r.payload, 1, 161), made, r.max_attempts}
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
  call_chunked('ZADD', delayed, later, 2)
  call_chunked('RPUSH', queue, back_end)
  call_chunked('RPUSH', dead, buried)
  for level, l in pairs(leveled) do
    -- newest claim first in l.front: the oldest goes first
    local f = {}
    for i = #l.front, 1, -1 do f[#f + 1] = l.front[i] end
    prio_add(prio, level, f, true)
    prio_add(prio, level, l.back, false)
    nleveled = nleveled + #l.front + #l.back
  end
  redis.call('DEL', held)
  return #front + #later / 2 + #back_end + nleveled, #buried, told
end

-- Rate limit of a queue: a token bucket of `rate` claims per `per` ms, on the
-- Redis clock. `bucket` ({ns}:rate:<Q>) holds the tokens left (a fraction)
-- and when (ms) they were counted; it refills at rate/per tokens per ms up
-- to `rate` (so a full bucket allows a burst of `rate` claims), and a
-- missing bucket is full. Returns the tokens there are at `now`.
local function rate_tokens(bucket, rate, per, now)
  local b = redis.call('HMGET', bucket, 'tokens', 'at')
  if not b[1] then return rate end
  return math.min(rate, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * rate / per)
end

-- The ms until `tokens` (fewer than one) have grown to one token.
local function rate_wait(tokens, rate, per)
  return math.max(1, math.ceil((1 - tokens) * per / rate))
end

-- Publish `message` on `channel`, a channel of the namespace (its name starts
-- with `{ns}:`, so it hashes to the namespace's slot). Sharded (SPUBLISH) where
-- the server has it (Redis 7.0+: `redis.REDIS_VERSION_NUM` is set) and the
-- user may run it: on a cluster it reaches the nodes of the namespace's shard
-- only, where PUBLISH is sent over the cluster bus to every node. Otherwise
-- (6.2, or an ACL without `spublish`) PUBLISH. Subscribers listen both ways
-- (SSUBSCRIBE where they can, and SUBSCRIBE): see Channels in README.md.
local function nudge(channel, message)
  if redis.REDIS_VERSION_NUM and pcall(redis.call, 'SPUBLISH', channel, message) then return end
  redis.call('PUBLISH', channel, message)
end

-- Tasks of queue Q became ready: wake up to `ready` + 1 of Q's idle servers
-- ({ns}:idle:<Q>: workers serving Q with a free slot whose last claim found
-- nothing to take). Each is removed from the set and gets the queue name on
-- its wake channel; it claims, and goes back into the set if it finds
-- nothing. Busy servers are not woken: they claim again when a slot frees.
-- One spare: a woken server may be held back by the fair share, or its
-- message lost (its heartbeat then brings the news, within H).
-- Call it before a script writes any task, where the count is known by then:
-- writes are not rolled back, so a refused SPOP or PUBLISH (an ACL without
-- them) then adds no task (a refused SPUBLISH falls back to PUBLISH). Nobody can claim before the script ends.
-- SPOP is not refused at the memory limit: a script that adds tasks writes
-- a "denyoom" command before it (see "At the memory limit" in README.md).
-- Returns how many were woken.
local function wake_idle(idle, wake_prefix, queue, ready)
  if ready <= 0 then return 0 end
  local ws = redis.call('SPOP', idle, ready + 1)
  for _, w in ipairs(ws) do nudge(wake_prefix .. w, queue) end
  return #ws
end

-- Running processes of `procs` whose payload is `payload` (all of them when
-- payload is false): a list of {id, worker}.
local function find_processes(procs, payload)
  local found = {}
  local all = redis.call('HGETALL', procs)
  for i = 1, #all, 2 do
    local rec = all[i + 1]
    if payload == false or #payload == 0 or string.sub(rec, -#payload) == payload then
      local r = unpack_record(rec)
      if payload == false or r.payload == payload then
        found[#found + 1] = {all[i], r.worker}
      end
    end
  end
  return found
end

-- The worker keys a cancelling script was given: worker ids are ARGV[a + j]
-- and their {held, inbox} keys KEYS[k + 2j - 1], KEYS[k + 2j], j = 1..n.
-- Returns the keys by worker, and, when a process in `found` runs on a
-- worker that is not among them, the reply the script must return at once
-- ({1, missing worker ids...}: the caller calls again with their keys).
local function worker_keys(found, a, k, n)
  local wkeys, missing, seen = {}, {1}, {}
  for j = 1, n do
    wkeys[ARGV[a + j]] = {KEYS[k + 2 * j - 1], KEYS[k + 2 * j]}
  end
  for _, f in ipairs(found) do
    if not wkeys[f[2]] and not seen[f[2]] then
      seen[f[2]] = true
      missing[#missing + 1] = f[2]
    end
  end
  if #missing > 1 then return wkeys, missing end
  return wkeys, nil
end

-- Cancel the running processes in `found`: drop their records, take them out
-- of their worker's held set, put their ids in the worker's durable inbox and
-- publish them on the worker's cancel channel. `wkeys[worker]` is
-- {held key, inbox key}.
local function cancel_found(found, procs, wkeys, cancel_prefix)
  for _, f in ipairs(found) do
    local id, worker = f[1], f[2]
    redis.call('HDEL', procs, id)
    redis.call('SREM', wkeys[worker][1], id)
    redis.call('SADD', wkeys[worker][2], id)
    nudge(cancel_prefix .. worker, id)
  end
end

-- Weights and capacities of a queue Q ({ns}:share:<Q>, a HASH):
--   ':weight'       T, the total weight of the persistent tasks of Q (their
--                   number when every weight is 1)
--   ':capacity'     C, the total capacity of the servers of Q (their number
--                   when every capacity is 1)
--   ':heavy'        how many persistent tasks of Q weigh other than 1
--   'w' .. payload  the weight of a persistent task of Q (default 1)
--   'c' .. W        the capacity of server W on Q (default 1)
--   'h' .. W        the weight of W's processes on Q beyond one each: the
--                   sum of (weight - 1) over them (default 0)
--   ':gen'          a generation: moves on with every change of the others,
--                   every rebalance mark and every reservation (see
--                   heartbeat.lua); never left out once written
-- A field is left out while it would hold 0 or its default. Worker ids
-- contain no ':', and the first byte tells the kinds apart. The sums are
-- kept by the scripts that change them, so fair_share reads one HMGET.

-- The weight of a persistent task of Q.
local function task_weight(share, payload)
  return tonumber(redis.call('HGET', share, 'w' .. payload) or '1')
end

-- Add `delta` to a whole-number field of the share hash, which is left out
-- when it comes to 0; a change moves the generation ':gen' on (heartbeat.lua
-- reads the share again only when it moved).
local function add_share(share, field, delta)
  if delta ~= 0 then
    if redis.call('HINCRBY', share, field, delta) == 0 then redis.call('HDEL', share, field) end
    redis.call('HINCRBY', share, ':gen', 1)
  end
end

-- New persistent tasks of Q, `n` of them of weight `weight` each.
local function add_tasks(share, n, weight)
  add_share(share, ':weight', n * weight)
  if weight ~= 1 then add_share(share, ':heavy', n) end
end

-- Set the weight of a persistent task of Q (it was `was`): its entry and
-- the sums. Returns the change.
local function set_weight(share, payload, weight, was)
  if weight == was then return 0 end
  if weight == 1 then
    redis.call('HDEL', share, 'w' .. payload)
  else
    redis.call('HSET', share, 'w' .. payload, weight)
  end
  add_share(share, ':weight', weight - was)
  add_share(share, ':heavy', (weight ~= 1 and 1 or 0) - (was ~= 1 and 1 or 0))
  return weight - was
end

-- The persistent task `payload` leaves Q (finished or cancelled): its
-- weight leaves the sums. Returns its weight.
local function forget_weight(share, payload)
  local w = task_weight(share, payload)
  set_weight(share, payload, 1, w)
  add_share(share, ':weight', -1)
  return w
end

-- W becomes a server of Q with capacity `cap` (`was`: its capacity as a
-- server already, or 0 if it was not one).
local function set_capacity(share, worker, cap, was)
  if cap == was then return end
  if cap == 1 or cap == 0 then
    redis.call('HDEL', share, 'c' .. worker)
  else
    redis.call('HSET', share, 'c' .. worker, cap)
  end
  add_share(share, ':capacity', cap - was)
end

-- W no longer serves Q: its capacity leaves the sum.
local function drop_capacity(share, worker)
  set_capacity(share, worker, 0, tonumber(redis.call('HGET', share, 'c' .. worker) or '1'))
end

-- W leaves Q with every process it held there: its held weight is
-- forgotten, and, if it was a server (`server`), its capacity leaves the sum.
local function leave_share(share, worker, server)
  if server then drop_capacity(share, worker) end
  redis.call('HDEL', share, 'h' .. worker)
end

-- The fair share of a queue, one HMGET: T, the total weight of its
-- persistent tasks (queued, delayed or running), C, the total capacity of
-- the workers that serve it (at least 1), and for `worker` its capacity and
-- the weight of its processes beyond one each (its held weight is SCARD of
-- its held set plus that). W's fair share is T * capacity / C; with every
-- weight and capacity 1, P / S, and every worker should hold floor(P / S)
-- or ceil(P / S).
local function fair_share(share, worker)
  local v = redis.call('HMGET', share, ':weight', ':capacity', 'c' .. worker, 'h' .. worker)
  return tonumber(v[1] or '0'), math.max(1, tonumber(v[2] or '0')),
    tonumber(v[3] or '1'), tonumber(v[4] or '0')
end

-- A balance entry ({ns}:moving:<Q> or {ns}:reserved:<Q> value): the worker
-- a task moves to and the Redis time (ms) the entry expires at, "W:ms".
local function parse_entry(v)
  local w, at = string.match(v, '^(.*):(%d+)$')
  return w, tonumber(at or '0')
end

-- Put the reservations of {ns}:reserved:<Q> that ran out (their worker did
-- not claim in time: it died, or left) back at the head of the queue, and
-- drop those of tasks that are no longer persistent (cancelled). Returns
-- how many went back, and the payloads reserved for `worker` still valid.
local function expire_reserved(reserved, queue, persistent, standby, now, worker)
  local back, mine = 0, {}
  local all = redis.call('HGETALL', reserved)
  for i = 1, #all, 2 do
    local payload = all[i]
    local w, at = string.match(all[i + 1], '^(.*):(%d+)$')  -- parse_entry, inlined
    at = tonumber(at or '0')
    if not is_queued_persistent(persistent, standby, payload) then
      redis.call('HDEL', reserved, payload)
    elseif at <= now then
      redis.call('HDEL', reserved, payload)
      redis.call('LPUSH', queue, payload)
      back = back + 1
    elseif w == worker then
      mine[#mine + 1] = payload
    end
  end
  return back, mine
end
