-- finish.lua: a worker reports processes as finished; their tasks leave the mesh.
--
-- KEYS[1] {ns}:worker:<W>        heartbeat key
-- KEYS[2] {ns}:procs:<Q>         HASH process id -> process record
-- KEYS[3] {ns}:held:<W>:<Q>      SET of W's process ids on Q
-- KEYS[4] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[5] {ns}:attempts:<Q>      HASH payload -> failed attempts
-- KEYS[6] {ns}:share:<Q>         HASH weights and capacities (README.md): a
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
-- Times: each finished one-shot job's enqueue time goes: one EXISTS of
--        {ns}:enqt:<Q> per call, and a ZREM while it exists
--        (include/enqueue_time.lua).
-- Publishes: the payload of each finished process on ARGV[3] (with KEYS[7]:
--            only if KEYS[7] exists).
--!include include/lease_error.lua
--!include include/hmget_all.lua
--!include include/finish_process.lua

local out = {}
if lease_error(KEYS[1], ARGV[1], ARGV[2]) then
  for i = 4, #ARGV do out[#out + 1] = 0 end
  return out
end
finish_begin(ARGV[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], ARGV[3], false)
-- One HMGET for every record, one HDEL and one SREM for every finished
-- process (not one of each per process): a runner reports a whole batch.
-- Of a record, only the fields a finish needs (include/record_head.lua).
local ids = {}
for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
out = finish_all(ids, hmget_all(KEYS[2], ids))
finish_writes()
return out
