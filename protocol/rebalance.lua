-- rebalance.lua: a worker W below its fair share of a queue's persistent
-- tasks asks the workers above theirs to hand back their surplus, reserved
-- for W. Nothing moves here: each chosen process is marked in
-- {ns}:moving:<Q>; its worker learns it from its heartbeat, cancels the
-- handler, and hands the process back (give_back mode "return") only once
-- the handler has exited (invariant 10); give_back then reserves the task
-- for W ({ns}:reserved:<Q>) and wakes W, whose next claim takes it first.
-- A reservation that W does not claim in time (W died) goes to the head of
-- the queue at the next claim or rebalance of anyone; a mark whose process
-- is gone (finished, recycled) or ran out is dropped.
--
-- The fair share is by weight against capacity (include/fair_share.lua): with
-- T the total weight of Q's persistent tasks and C the total capacity of its
-- servers, worker V's share is T * cap(V) / C, and what V holds is the
-- weight of its processes; what is on its way counts (a task marked away
-- counts for its receiver, not its holder; a reservation for its receiver).
-- W asks only while it holds at most its share - 1 (hysteresis: with every
-- weight and capacity 1, below floor(P / S)). A task of weight x moves from
-- V to W only if W stays at or below its share (x <= W's deficit) and V
-- stays above its share - 1 (x < V's surplus + 1): so neither asks back,
-- nothing bounces, and every move goes to a worker below its share, none to
-- a third. Donors with the largest surplus give first, their oldest
-- processes that fit first, at most ARGV[4] tasks per call: the minimum
-- number of moves. A worker whose surplus is only tasks too heavy to fit
-- keeps them: a balanced mesh holds each share within one task's weight.
--
-- KEYS[1] {ns}:worker:<W>        heartbeat key
-- KEYS[2] {ns}:servers:<Q>       SET of the workers that serve Q
-- KEYS[3] {ns}:persistent:<Q>    HASH persistent payload -> process id or ""
-- KEYS[4] {ns}:standby:<Q>       SET of queued or delayed persistent payloads
-- KEYS[5] {ns}:procs:<Q>         HASH process id -> process record
-- KEYS[6] {ns}:moving:<Q>        HASH process id -> "R:expiry ms" (written here)
-- KEYS[7] {ns}:reserved:<Q>      HASH payload -> "R:expiry ms"
-- KEYS[8] {ns}:queue:<Q>         LIST of queued payloads (expired reservations go to its head)
-- KEYS[9] {ns}:share:<Q>        HASH weights and capacities (README.md)
-- KEYS[10..9+m] {ns}:held:<W_j>:<Q> for each worker W_j named in ARGV[7..]
-- ARGV[1] worker id W
-- ARGV[2] incarnation
-- ARGV[3] queue name Q
-- ARGV[4] at most this many tasks moved to W by this call (1..1000)
-- ARGV[5] how long a mark and a reservation last, in ms (the receiver must
--         claim within this; the holder's handler should exit within it)
-- ARGV[6] prefix of wake channels ({ns}:wake:)
-- ARGV[7..6+m] the workers that serve Q, as the caller knows them
-- Returns: {1, tasks marked for W, T, C, W's held weight}; {0, 0, T, C,
--          W's held weight}
--          when W is not below its share or nobody is above theirs;
--          {2, W_1, ...} when the servers of Q are not the ones named in
--          ARGV (nothing changed: call again with these).
-- Errors: FENCED, NOT_SERVING (W does not serve Q), BAD_ARG.
-- Publishes: Q on the wake channels of idle servers for reservations that
--            ran out and went back to the queue.
--!include include/now_ms.lua
--!include include/int.lua
--!include include/record.lua
--!include include/lease_error.lua
--!include include/count_arg.lua
--!include include/sorted_ids.lua
--!include include/hmget_all.lua
--!include include/nudge.lua
--!include include/task_weight.lua
--!include include/fair_share.lua
--!include include/parse_entry.lua
--!include include/expire_reserved.lua

local limit, err = count_arg(ARGV[4], 'move limit', 1000)
if err then return err end
if limit < 1 then return redis.error_reply('BAD_ARG move limit must be >= 1') end
local hold
hold, err = count_arg(ARGV[5], 'hold ms')
if err then return err end
if #KEYS ~= 9 + (#ARGV - 6) then
  return redis.error_reply('BAD_ARG expected one held key per named worker')
end
err = lease_error(KEYS[1], ARGV[1], ARGV[2])
if err then return err end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 0 then
  return redis.error_reply('NOT_SERVING worker ' .. ARGV[1] .. ' does not serve queue ' .. ARGV[3])
end
local servers = redis.call('SMEMBERS', KEYS[2])
local named = {}
for j = 7, #ARGV do named[ARGV[j]] = 9 + j - 6 end
local same = #servers == #ARGV - 6
for _, w in ipairs(servers) do
  if not named[w] then same = false end
end
if not same then
  local out = {2}
  for _, w in ipairs(servers) do out[#out + 1] = w end
  return out
end

local now = now_ms()
local share = KEYS[9]
local weighted = redis.call('HEXISTS', share, ':heavy') == 1
local function weight_of(payload)
  return weighted and task_weight(share, payload) or 1
end
-- What each server holds, by weight, and its capacity: one HMGET.
local count, capacity = {}, {}
local fields = {}
for _, w in ipairs(servers) do
  fields[#fields + 1] = 'h' .. w
  fields[#fields + 1] = 'c' .. w
end
local vals = hmget_all(share, fields)
for j, w in ipairs(servers) do
  count[w] = redis.call('SCARD', KEYS[named[w]]) + tonumber(vals[2 * j - 1] or '0')
  capacity[w] = tonumber(vals[2 * j] or '1')
end
-- Marks whose process is gone or ran out are dropped; reservations that ran
-- out go to the head of the queue. What remains is on its way.
local marked = {}
if redis.call('EXISTS', KEYS[6]) == 1 then
  local all = redis.call('HGETALL', KEYS[6])
  for i = 1, #all, 2 do
    local pid = all[i]
    local to, at = parse_entry(all[i + 1])
    local rec = redis.call('HGET', KEYS[5], pid)
    if not rec or at <= now then
      redis.call('HDEL', KEYS[6], pid)
    else
      local r = unpack_record(rec)
      local x = weight_of(r.payload)
      marked[pid] = true
      if count[r.worker] then count[r.worker] = count[r.worker] - x end
      if count[to] then count[to] = count[to] + x end
    end
  end
end
if redis.call('EXISTS', KEYS[7]) == 1 then
  local back = expire_reserved(KEYS[7], KEYS[8], KEYS[3], KEYS[4], now, '')
  local all = redis.call('HGETALL', KEYS[7])
  for i = 1, #all, 2 do
    local to = parse_entry(all[i + 1])
    if count[to] then count[to] = count[to] + weight_of(all[i]) end
  end
  if back > 0 then
    -- wake the queue's servers once: anyone may take them now
    for _, w in ipairs(servers) do nudge(ARGV[6] .. w, ARGV[3]) end
  end
end

local total, cap_sum = fair_share(share, ARGV[1])
local function fair(w) return total * capacity[w] / cap_sum end
local mine = count[ARGV[1]]
local deficit = fair(ARGV[1]) - mine
if deficit < 1 then return {0, 0, total, cap_sum, mine} end

-- Donors: the workers above their share, the largest surplus first.
local donors = {}
for _, w in ipairs(servers) do
  local surplus = count[w] - fair(w)
  if surplus > 0 and w ~= ARGV[1] then donors[#donors + 1] = {w, surplus} end
end
table.sort(donors, function(a, b)
  if a[2] ~= b[2] then return a[2] > b[2] end
  return a[1] < b[1]
end)

local entry = ARGV[1] .. ':' .. int(now + hold)
local moved = 0
for _, d in ipairs(donors) do
  if moved >= limit or deficit < 1 then break end
  local surplus = d[2]
  for _, pid in ipairs(sorted_ids(redis.call('SMEMBERS', KEYS[named[d[1]]]))) do
    if moved >= limit or deficit < 1 or surplus <= 0 then break end
    if not marked[pid] then
      local rec = redis.call('HGET', KEYS[5], pid)
      local r = rec and unpack_record(rec)
      if r and r.persistent then
        local x = weight_of(r.payload)
        if x <= deficit and x < surplus + 1 then
          redis.call('HSET', KEYS[6], pid, entry)
          moved, deficit, surplus = moved + 1, deficit - x, surplus - x
        end
      end
    end
  end
end
-- the holders learn of their marks from a heartbeat: it reads the share again
if moved > 0 then redis.call('HINCRBY', share, ':gen', 1) end
return {1, moved, total, cap_sum, mine}
