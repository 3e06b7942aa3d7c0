-- ensure.lua: make payloads persistent tasks of a queue, each unique per
-- (queue, payload): a payload that is already a persistent task of Q (queued,
-- delayed or running) is left alone; one that is queued, delayed or running
-- as a one-shot task of Q is refused, as enqueue.lua refuses the reverse. Every
-- payload gets the weight ARGV[3] (its part of the fair share: see
-- include/fair_share.lua), a persistent task already there too (if it runs, its
-- worker's held weight follows).
--
-- KEYS[1] {ns}:queue:<Q>         LIST of queued payloads
-- KEYS[2] {ns}:queues            SET of known queue names
-- KEYS[3] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[4] {ns}:standby:<Q>       SET of persistent payloads queued or delayed (those not kept as "" in the hash)
-- KEYS[5] {ns}:idle:<Q>          SET of idle servers of Q (see include/wake_idle.lua)
-- KEYS[6] {ns}:delayed:<Q>       ZSET of payloads waiting for a retry
-- KEYS[7] {ns}:unowned:<Q>        ZSET persistent payload -> since when (ms) no process runs it
-- KEYS[8] {ns}:share:<Q>         HASH weights and capacities (README.md)
-- KEYS[9] {ns}:procs:<Q>         HASH process id -> process record (read: the
--                                worker of a running task whose weight changes,
--                                and one-shot processes of a new payload)
-- KEYS[10] {ns}:prio:<Q>         ZSET of queued one-shot tasks with a priority (include/prio_add.lua)
-- ARGV[1] queue name Q
-- ARGV[2] prefix of wake channels ({ns}:wake:)
-- ARGV[3] the weight of the payloads, a whole number from 1 to 1000000
-- ARGV[4..] payloads
-- Returns: per payload 1 if added, 0 if it existed already.
-- Blobs: each stand-in added counts one reference (include/blob.lua).
-- Errors: CONFLICT (a payload is queued, delayed or running as a one-shot
--         task of Q, or a new stand-in whose blob is gone: nothing was
--         added), BAD_ARG (weight), OOM (Redis is at
--         maxmemory: nothing changed, even for payloads already there).
-- Cost: the one-shot check reads the queue (LPOS, or one pass for many
--       payloads): O(queue length) when the queue holds tasks, the tasks
--       with a priority, if any, and the records of Q's running processes
--       (O(running)) when a payload is new.
-- Publishes: Q on the wake channels of up to (number added) + 1 idle servers.
--!include include/now_ms.lua
--!include include/record.lua
--!include include/is_persistent.lua
--!include include/call_chunked.lua
--!include include/to_standby.lua
--!include include/wake_idle.lua
--!include include/task_weight.lua
--!include include/add_share.lua
--!include include/add_tasks.lua
--!include include/set_weight.lua
--!include include/blob.lua
local blobs = blob_lib()

local weight = tonumber(ARGV[3])
if not weight or weight < 1 or weight > 1000000 or weight ~= math.floor(weight) then
  return redis.error_reply('BAD_ARG weight must be a whole number from 1 to 1000000')
end
local out, new, seen, old = {}, {}, {}, {}
for i = 4, #ARGV do
  local p = ARGV[i]
  if seen[p] then
    out[#out + 1] = 0
  elseif is_persistent(KEYS[3], KEYS[4], p) then
    out[#out + 1] = 0
    seen[p] = i - 4
    old[#old + 1] = p
  else
    seen[p] = i - 4  -- a payload given twice is added once (i - 4: its place in the call)
    new[#new + 1] = p
    out[#out + 1] = 1
  end
end
-- Not persistent, yet in the queue or the delayed set: a one-shot copy.
local function conflict(p)
  return redis.error_reply('CONFLICT task ' .. seen[p] .. ' of this call is a one-shot task of queue '
    .. ARGV[1] .. '; a payload is one-shot or persistent in a queue, not both')
end
for _, p in ipairs(new) do
  if redis.call('ZSCORE', KEYS[6], p) then return conflict(p) end
end
-- Running as a one-shot task: a process of Q whose record (see
-- include/record.lua) has the kind "o".."o9" and ends with the payload. (A persistent
-- process of a new payload was cancelled: its handler may still be exiting.)
if #new > 0 and redis.call('HLEN', KEYS[9]) > 0 then
  local wanted = {}
  for _, p in ipairs(new) do wanted[p] = true end
  for _, rec in ipairs(redis.call('HVALS', KEYS[9])) do
    local p = string.match(rec, '^[^%z]*%zo%d?%z[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z(.*)$')
    if p and wanted[p] then
      return redis.error_reply('CONFLICT task ' .. seen[p] .. ' of this call runs as a one-shot task of queue '
        .. ARGV[1] .. '; a payload is one-shot or persistent in a queue, not both')
    end
  end
end
if #new > 0 and redis.call('EXISTS', KEYS[10]) == 1 then
  for _, m in ipairs(redis.call('ZRANGE', KEYS[10], 0, -1)) do
    if seen[string.sub(m, 17)] then return conflict(string.sub(m, 17)) end
  end
end
local len = #new > 0 and redis.call('LLEN', KEYS[1]) or 0
local is_new = {}
for _, p in ipairs(new) do is_new[p] = true end
if len > 0 and #new <= 8 then
  for _, p in ipairs(new) do
    if redis.call('LPOS', KEYS[1], p) then return conflict(p) end
  end
elseif len > 0 then
  for i = 0, len - 1, 1000 do
    for _, p in ipairs(redis.call('LRANGE', KEYS[1], i, i + 999)) do
      if is_new[p] then return conflict(p) end
    end
  end
end
local prefix = blobs.prefix(KEYS[2])
local gone, big = blobs.missing(prefix, new, 1)
if gone then return blobs.gone(seen[new[gone]]) end
redis.call('SADD', KEYS[2], ARGV[1])  -- the first write, refused at the memory limit
if big then
  for _, p in ipairs(new) do blobs.ref(prefix, p) end
end
wake_idle(KEYS[5], ARGV[2], ARGV[1], #new)  -- before any task is written, as in enqueue.lua
to_standby(KEYS[3], KEYS[4], new, false, KEYS[7], now_ms())
call_chunked('RPUSH', KEYS[1], new)
if weight ~= 1 and #new > 0 then
  local fields = {}
  for _, p in ipairs(new) do
    fields[#fields + 1] = 'w' .. p
    fields[#fields + 1] = weight
  end
  call_chunked('HSET', KEYS[8], fields, 2)
end
add_tasks(KEYS[8], #new, weight)
-- Tasks already there take the weight given: only a change costs a write.
local heavy = #old > 0 and (weight ~= 1 or redis.call('HEXISTS', KEYS[8], ':heavy') == 1)
for _, p in ipairs(heavy and old or {}) do
  local delta = set_weight(KEYS[8], p, weight, task_weight(KEYS[8], p))
  local pid = delta ~= 0 and redis.call('HGET', KEYS[3], p)
  local rec = pid and pid ~= '' and redis.call('HGET', KEYS[9], pid)
  if rec then add_share(KEYS[8], 'h' .. unpack_record(rec).worker, delta) end
end
return out
