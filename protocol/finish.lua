-- finish.lua: a worker reports processes as finished; their tasks leave the mesh.
--
-- KEYS[1] {ns}:worker:<W>        heartbeat key
-- KEYS[2] {ns}:procs:<Q>         HASH process id -> process record
-- KEYS[3] {ns}:held:<W>:<Q>      SET of W's process ids on Q
-- KEYS[4] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see lib.lua to_standby)
-- KEYS[5] {ns}:attempts:<Q>      HASH payload -> failed attempts
-- KEYS[6] {ns}:share:<Q>         HASH weights and capacities (lib.lua): a
--                                finished persistent task's weight leaves it
-- KEYS[7] (optional) {ns}:awaiting:<Q>  STRING that exists while someone
--                                awaits Q's done messages (client.result
--                                keeps it alive); given, a done message is
--                                published only while it exists
-- ARGV[1] worker id W
-- ARGV[2] incarnation
-- ARGV[3] the done channel of Q ({ns}:done:<Q>)
-- ARGV[4..] process ids
-- Returns: per process id, 1 if it was W's live process and is now finished,
--          0 if not (already recycled, cancelled, finished, or W holds no lease:
--          then nothing changes at all).
-- Errors: none.
-- Publishes: the payload of each finished process on ARGV[3] (with KEYS[7]:
--            only if KEYS[7] exists).
--!include lib.lua

local out = {}
if lease_error(KEYS[1], ARGV[1], ARGV[2]) then
  for i = 4, #ARGV do out[#out + 1] = 0 end
  return out
end
local weighted  -- whether any task of Q weighs other than 1: read at the first persistent one
local notify  -- whether to publish done messages: read at the first finished process
-- One HMGET for every record, one HDEL and one SREM for every finished
-- process (not one of each per process): a runner reports a whole batch.
-- Of a record, only the fields a finish needs (lib.lua record_head).
local recs = {}
if #ARGV > 1003 then
  local ids = {}
  for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
  recs = hmget_all(KEYS[2], ids)
elseif #ARGV > 3 then
  recs = redis.call('HMGET', KEYS[2], unpack(ARGV, 4))  -- the ids as they came
end
local wz = ARGV[1] .. '\0'
local gone, seen, attempts = {}, {}, {}
for i = 1, #ARGV - 3 do
  local id, rec = ARGV[i + 3], recs[i]
  local done = 0
  if rec and not seen[id] then
    seen[id] = true
    local kind, tries, payload = record_head(rec, wz)
    if kind then
      gone[#gone + 1] = id
      local persistent = kind == 'p'
      if persistent then
        if weighted == nil then weighted = redis.call('HEXISTS', KEYS[6], ':heavy') == 1 end
        local w = weighted and task_weight(KEYS[6], payload) or 1
        -- HDEL before HINCRBY: the first write must be one Redis does not
        -- refuse at the memory limit (see "At the memory limit" in README.md)
        local mine = redis.call('HGET', KEYS[4], payload) == id
        if mine then redis.call('HDEL', KEYS[4], payload) end
        add_share(KEYS[6], 'h' .. ARGV[1], 1 - w)  -- its weight leaves W's held weight
        if mine then
          forget_weight(KEYS[6], payload)  -- the task leaves: its weight leaves the sums
        end
      end
      if persistent or tries ~= '0' then attempts[#attempts + 1] = payload end
      if notify == nil then notify = not KEYS[7] or redis.call('EXISTS', KEYS[7]) == 1 end
      if notify then nudge(ARGV[3], payload) end
      done = 1
    end
  end
  out[#out + 1] = done
end
call_chunked('HDEL', KEYS[2], gone)
call_chunked('SREM', KEYS[3], gone)
call_chunked('HDEL', KEYS[5], attempts)
return out
