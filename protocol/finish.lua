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
for i = 4, #ARGV do
  local id = ARGV[i]
  local rec = redis.call('HGET', KEYS[2], id)
  local done = 0
  if rec then
    local r = unpack_record(rec)
    if r.worker == ARGV[1] then
      redis.call('HDEL', KEYS[2], id)
      redis.call('SREM', KEYS[3], id)
      local w = (r.persistent and weighted) and task_weight(KEYS[6], r.payload) or 1
      add_share(KEYS[6], 'h' .. ARGV[1], 1 - w)  -- its weight leaves W's held weight
      if r.persistent and redis.call('HGET', KEYS[4], r.payload) == id then
        redis.call('HDEL', KEYS[4], r.payload)
        forget_weight(KEYS[6], r.payload)  -- the task leaves: its weight leaves the sums
      end
      if r.attempts > 0 or r.persistent then redis.call('HDEL', KEYS[5], r.payload) end
      redis.call('PUBLISH', ARGV[3], r.payload)
      done = 1
    end
  end
  out[#out + 1] = done
end
return out
