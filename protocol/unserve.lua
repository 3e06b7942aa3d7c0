-- unserve.lua: a worker stops serving a queue and hands every process it
-- holds on that queue back to the front of the queue.
--
-- KEYS[1] {ns}:serves:<W>        SET of queues W serves
-- KEYS[2] {ns}:held:<W>:<Q>      SET of W's process ids on Q
-- KEYS[3] {ns}:procs:<Q>         HASH process id -> process record
-- KEYS[4] {ns}:queue:<Q>         LIST of queued payloads
-- KEYS[5] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[6] {ns}:attempts:<Q>      (passed for the shared helper; not written)
-- KEYS[7] {ns}:dead:<Q>          (passed for the shared helper; not written)
-- KEYS[8] {ns}:servers:<Q>       SET of the workers that serve Q
-- KEYS[9] {ns}:delayed:<Q>       (passed for the shared helper; not written)
-- KEYS[10] {ns}:standby:<Q>      SET of persistent payloads queued or delayed (those not kept as "" in the hash); a
--                                handed-back one moves there from KEYS[5]
-- KEYS[11] {ns}:idle:<Q>         SET of idle servers of Q (see include/wake_idle.lua)
-- KEYS[12] {ns}:unowned:<Q>        ZSET persistent payload -> since when (ms) no process runs it
-- KEYS[13] {ns}:share:<Q>       HASH weights and capacities (README.md): W's
--                                capacity and held weight leave it
-- KEYS[14] {ns}:prio:<Q>         ZSET of queued tasks with a priority: one goes back to the
--                                front of its level (include/prio_add.lua)
-- KEYS[15] {ns}:delayed_prio:<Q> (passed for the shared helper; not written)
-- ARGV[1] queue name Q
-- ARGV[2] prefix of wake channels ({ns}:wake:)
-- ARGV[3] worker id W
-- Returns: how many processes were handed back.
-- Errors: none.
-- Publishes: Q on the wake channels of up to (that number) + 1 idle servers
--            of Q, if it is not 0.
--!include include/now_ms.lua
--!include include/return_held.lua
--!include include/wake_idle.lua
--!include include/leave_share.lua

local back = return_held(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[9], false,
  now_ms(), KEYS[10], KEYS[12], KEYS[14], KEYS[15])
redis.call('SREM', KEYS[1], ARGV[1])
local server = redis.call('SREM', KEYS[8], ARGV[3]) == 1
redis.call('SREM', KEYS[11], ARGV[3])
leave_share(KEYS[13], ARGV[3], server)
wake_idle(KEYS[11], ARGV[2], ARGV[1], back)
return back
