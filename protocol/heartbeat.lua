-- heartbeat.lua: renew a worker's lease; collect its durable cancels; say which
-- of its queues have work and how many processes Redis says it holds there;
-- say when the next peer lease runs out; say whether W is in each queue's
-- idle set.
--
-- KEYS[1] {ns}:worker:<W>   heartbeat key
-- KEYS[2] {ns}:workers      ZSET lease deadlines
-- KEYS[3] {ns}:inbox:<W>    SET of cancelled process ids not yet acknowledged
-- KEYS[4 + 10i] .. KEYS[13 + 10i] for each served queue i = 0..n-1:
--         {ns}:queue:<Q>, {ns}:delayed:<Q>, {ns}:held:<W>:<Q>, {ns}:idle:<Q>,
--         {ns}:persistent:<Q>, {ns}:standby:<Q>, {ns}:servers:<Q>,
--         {ns}:moving:<Q>, {ns}:reserved:<Q>, {ns}:prio:<Q> (tasks with a
--         priority count as ready)
-- ARGV[1] worker id W
-- ARGV[2] incarnation
-- ARGV[3] ttl in ms
-- ARGV[4] number k of acknowledged cancels, then ARGV[5..4+k] their process ids
-- Returns: {now_ms, ms until the earliest lease deadline of any worker,
--           {inbox process ids}, {per queue: 0 = tasks ready, -1 = none,
--           N = ms until the earliest delayed task is due},
--           {per queue: how many processes W holds there},
--           {per queue: 1 if W is in its idle set, else 0},
--           {per queue: how many servers are in its idle set},
--           {per queue: how many persistent tasks it has},
--           {per queue: how many workers serve it},
--           {per queue: {ids of W's processes a rebalance asked W to hand
--            back (see rebalance.lua)}}}
--          A queue with a task reserved for W, or a reservation that ran
--          out, counts as having tasks ready (state 0).
--          A worker that runs more processes of a queue than Redis says it
--          holds must find out which are gone (they were lost, e.g. by a
--          failover that dropped writes) and stop them. A worker with a
--          free slot on a queue, not held back by the fair share, that is
--          not in its idle set claims: nobody would wake it (its wake was
--          lost). Every idle server learns when a delayed task is due; the
--          idle count lets about three of them act on it, not all.
-- Errors: FENCED (lease expired, recycled or superseded: the worker must stop
--         every process and re-register under a new id), BAD_ARG.
-- Publishes: nothing.
--!include lib.lua

local ttl, err = count_arg(ARGV[3], 'ttl')
if err then return err end
local k
k, err = count_arg(ARGV[4], 'ack count', #ARGV - 4)
if err then return err end
err = lease_error(KEYS[1], ARGV[1], ARGV[2])
if err then return err end

local now = now_ms()
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
for i = 5, 4 + k do redis.call('SREM', KEYS[3], ARGV[i]) end
local inbox = redis.call('SMEMBERS', KEYS[3])

local states, held, idle, idles, pers, servers, release = {}, {}, {}, {}, {}, {}, {}
for i = 4, #KEYS, 10 do
  local p, sv = fair_share(KEYS[i + 4], KEYS[i + 5], KEYS[i + 6])
  pers[#pers + 1], servers[#servers + 1] = p, sv
  local mine = {}
  -- one call in the usual case: nothing is moving or reserved
  local balancing = redis.call('EXISTS', KEYS[i + 7], KEYS[i + 8]) > 0
  if balancing and redis.call('EXISTS', KEYS[i + 7]) == 1 then
    local all = redis.call('HGETALL', KEYS[i + 7])
    for j = 1, #all, 2 do
      if redis.call('SISMEMBER', KEYS[i + 2], all[j]) == 1 then mine[#mine + 1] = all[j] end
    end
  end
  release[#release + 1] = mine
  local reserved = false
  if balancing and redis.call('EXISTS', KEYS[i + 8]) == 1 then
    local all = redis.call('HGETALL', KEYS[i + 8])
    for j = 2, #all, 2 do
      local w, at = parse_entry(all[j])
      if w == ARGV[1] or at <= now then reserved = true end
    end
  end
  held[#held + 1] = redis.call('SCARD', KEYS[i + 2])
  idle[#idle + 1] = redis.call('SISMEMBER', KEYS[i + 3], ARGV[1])
  idles[#idles + 1] = redis.call('SCARD', KEYS[i + 3])
  local state = -1
  if reserved or redis.call('EXISTS', KEYS[i], KEYS[i + 9]) > 0 then
    state = 0
  else
    local first = redis.call('ZRANGE', KEYS[i + 1], 0, 0, 'WITHSCORES')
    if #first > 0 then state = math.max(0, tonumber(first[2]) - now) end
  end
  states[#states + 1] = state
end

local earliest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
return {now, tonumber(earliest[2]) - now, inbox, states, held, idle, idles, pers, servers, release}
