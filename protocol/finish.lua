-- finish.lua: a worker reports processes as finished; their tasks leave the mesh.
--
-- KEYS[1] {ns}:worker:<W>        heartbeat key
-- KEYS[2] {ns}:procs:<Q>         HASH process id -> process record
-- KEYS[3] {ns}:held:<W>:<Q>      SET of W's process ids on Q
-- KEYS[4] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see lib.lua to_standby)
-- KEYS[5] {ns}:attempts:<Q>      HASH payload -> failed attempts
-- KEYS[6] {ns}:share:<Q>         HASH weights and capacities (lib.lua): a
--                                finished persistent task's weight leaves it
-- ARGV[1] worker id W
-- ARGV[2] incarnation
-- ARGV[3] the done channel of Q ({ns}:done:<Q>)
-- ARGV[4..] process ids
-- Returns: per process id, 1 if it was W's live process and is now finished,
--          0 if not (already recycled, cancelled, finished, or W holds no lease:
--          then nothing changes at all).
-- Errors: none.
-- Publishes: the payload of each finished process on ARGV[3].
--!include lib.lua

local out = {}
if lease_error(KEYS[1], ARGV[1], ARGV[2]) then
  for i = 4, #ARGV do out[#out + 1] = 0 end
  return out
end
local weighted = redis.call('HEXISTS', KEYS[6], ':heavy') == 1
-- One HMGET for every record, one HDEL and one SREM for every finished
-- process (not one of each per process): a runner reports a whole batch.
-- The fields of a record (see lib.lua pack_record) that a finish needs:
-- one match, not a table of all nine fields.
local function record_head(rec)
  local w, kind, attempts, payload = string.match(rec,
    '^([^%z]*)%z([^%z]*)%z(%d+)%z[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z[^%z]*%z(.*)$')
  return {worker = w, persistent = (kind == 'p'), attempts = tonumber(attempts), payload = payload}
end
local ids = {}
for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
local recs = hmget_all(KEYS[2], ids)
local gone, seen, attempts = {}, {}, {}
for i, id in ipairs(ids) do
  local rec = recs[i]
  local done = 0
  if rec and not seen[id] then
    seen[id] = true
    local r = record_head(rec)
    if r.worker == ARGV[1] then
      gone[#gone + 1] = id
      local w = (r.persistent and weighted) and task_weight(KEYS[6], r.payload) or 1
      add_share(KEYS[6], 'h' .. ARGV[1], 1 - w)  -- its weight leaves W's held weight
      if r.persistent and redis.call('HGET', KEYS[4], r.payload) == id then
        redis.call('HDEL', KEYS[4], r.payload)
        forget_weight(KEYS[6], r.payload)  -- the task leaves: its weight leaves the sums
      end
      if r.attempts > 0 or r.persistent then attempts[#attempts + 1] = r.payload end
      nudge(ARGV[3], r.payload)
      done = 1
    end
  end
  out[#out + 1] = done
end
call_chunked('HDEL', KEYS[2], gone)
call_chunked('SREM', KEYS[3], gone)
call_chunked('HDEL', KEYS[5], attempts)
return out
