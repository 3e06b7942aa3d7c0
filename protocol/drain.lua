-- drain.lua: a worker begins a graceful stop of a queue. From now on it is
-- no longer one of Q's servers: it claims nothing more there (claim.lua
-- answers NOT_SERVING), nobody wakes it, no rebalance moves a task to or
-- from it, and its capacity leaves the fair share, so its peers' shares
-- count only the workers that stay. It keeps the processes it holds: it
-- hands each back as its handler exits (give_back), and unserve or its
-- retirement (recycle) ends the stop; if it dies instead, its peers recycle
-- them as usual. So what a stopping worker hands back is claimed at once by
-- the peers with room, none of them held back by a share that still counted
-- the worker that leaves.
--
-- KEYS[1] {ns}:worker:<W>    heartbeat key
-- KEYS[2] {ns}:servers:<Q>   SET of the workers that serve Q: W leaves it
-- KEYS[3] {ns}:idle:<Q>      SET of idle servers of Q: W leaves it
-- KEYS[4] {ns}:share:<Q>     HASH weights and capacities (README.md): W's
--                            capacity leaves the sum (its held weight stays
--                            until its processes are handed back)
-- ARGV[1] worker id W
-- ARGV[2] incarnation
-- Returns: 1 if W served Q until now, 0 if it did not (already drained, or
--          never served it: nothing changed).
-- Errors: FENCED (W holds no lease; nothing changed).
-- Publishes: nothing.
--!include include/lease_error.lua
--!include include/drop_capacity.lua

local err = lease_error(KEYS[1], ARGV[1], ARGV[2])
if err then return err end
redis.call('SREM', KEYS[3], ARGV[1])
if redis.call('SREM', KEYS[2], ARGV[1]) == 0 then return 0 end
drop_capacity(KEYS[4], ARGV[1])
return 1
