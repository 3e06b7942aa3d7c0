-- heartbeat.lua: renew a worker's lease; collect its durable cancels; say which
-- of its queues have work and how many processes Redis says it holds there;
-- say when the next peer lease runs out; say whether W is in each queue's
-- idle set.
--
-- KEYS[1] {ns}:worker:<W>   heartbeat key
-- KEYS[2] {ns}:workers      ZSET lease deadlines
-- KEYS[3] {ns}:inbox:<W>    SET of cancelled process ids not yet acknowledged
-- KEYS[4 + 8i] .. KEYS[11 + 8i] for each served queue i = 0..n-1:
--         {ns}:queue:<Q>, {ns}:delayed:<Q>, {ns}:held:<W>:<Q>, {ns}:idle:<Q>,
--         {ns}:moving:<Q>, {ns}:reserved:<Q>, {ns}:share:<Q>, {ns}:prio:<Q>
--         (tasks with a priority count as ready)
-- ARGV[1] worker id W
-- ARGV[2] incarnation
-- ARGV[3] ttl in ms
-- ARGV[4] number k of acknowledged cancels, then ARGV[5..4+k] their process ids
-- ARGV[5+k .. 4+k+n] (optional) per queue, the generation of its share hash
--         (field ':gen') the caller last saw with nothing moving or reserved
--         (see Returns); "" or missing: none
-- Returns: {now_ms, ms until the earliest lease deadline of any worker,
--           {inbox process ids}, {per queue: 0 = tasks ready, -1 = none,
--           N = ms until the earliest delayed task is due},
--           {per queue: how many processes W holds there},
--           {per queue: 1 if W is in its idle set, else 0},
--           {per queue: how many servers are in its idle set},
--           {per queue, one after the other: the balance}}, the last
--          left out when it would be {0, 0, ...} (every queue unchanged).
--          The balance of a queue: {0} when the generation given is the
--          share hash's (nothing that the fair share or a rebalance depends
--          on changed since: the caller's last balance holds); otherwise
--          {1, generation (-1 while anything of Q is moving or reserved: not
--          to be given back), T (the total weight of Q's persistent tasks),
--          C (the total capacity of its servers), W's capacity, the weight
--          of W's processes beyond one each (add the held count for its
--          held weight), n, then the n ids of W's processes a rebalance
--          asked W to hand back (see rebalance.lua)}. W's fair share is
--          T * capacity / C (lib.lua fair_share). The generation moves on
--          with every change of the share hash (lib.lua add_share), every
--          mark (rebalance) and every reservation (give_back).
--          A queue with a task reserved for W, or a reservation that ran
--          out, counts as having tasks ready (state 0).
--          A worker that runs more processes of a queue than Redis says it
--          holds must find out which are gone (they were lost, e.g. by a
--          failover that dropped writes) and stop them. A worker with a
--          free slot on a queue, not held back by the fair share, that is
--          not in its idle set claims: nobody would wake it (its wake was
--          lost). Every idle server learns when a delayed task is due; the
--          idle count lets about three of them act on it, not all.
-- Cost: with nothing moving or reserved and the generation unchanged (the
--       usual case), one HGET per queue for the balance.
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

local states, held, idle, idles, balance = {}, {}, {}, {}, {}
local q, news = 0, false
for i = 4, #KEYS, 8 do
  q = q + 1
  local gen = redis.call('HGET', KEYS[i + 6], ':gen') or '0'
  local reserved = false
  if ARGV[4 + k + q] == gen then
    balance[#balance + 1] = 0
  else
    news = true
    local p, sv, cap, extra = fair_share(KEYS[i + 6], ARGV[1])
    local mine = {}
    local moving = redis.call('EXISTS', KEYS[i + 4]) == 1
    if moving then
      local all = redis.call('HGETALL', KEYS[i + 4])
      for j = 1, #all, 2 do
        if redis.call('SISMEMBER', KEYS[i + 2], all[j]) == 1 then mine[#mine + 1] = all[j] end
      end
    end
    local some = redis.call('EXISTS', KEYS[i + 5]) == 1
    if some then
      local all = redis.call('HGETALL', KEYS[i + 5])
      for j = 2, #all, 2 do
        local w, at = parse_entry(all[j])
        if w == ARGV[1] or at <= now then reserved = true end
      end
    end
    for _, x in ipairs({1, (moving or some) and -1 or tonumber(gen), p, sv, cap, extra, #mine}) do
      balance[#balance + 1] = x
    end
    for _, id in ipairs(mine) do balance[#balance + 1] = id end
  end
  held[#held + 1] = redis.call('SCARD', KEYS[i + 2])
  idle[#idle + 1] = redis.call('SISMEMBER', KEYS[i + 3], ARGV[1])
  idles[#idles + 1] = redis.call('SCARD', KEYS[i + 3])
  local state = -1
  if reserved or redis.call('EXISTS', KEYS[i], KEYS[i + 7]) > 0 then
    state = 0
  else
    local first = redis.call('ZRANGE', KEYS[i + 1], 0, 0, 'WITHSCORES')
    if #first > 0 then state = math.max(0, tonumber(first[2]) - now) end
  end
  states[#states + 1] = state
end

local earliest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
local out = {now, tonumber(earliest[2]) - now, inbox, states, held, idle, idles}
if news then out[8] = balance end
return out
