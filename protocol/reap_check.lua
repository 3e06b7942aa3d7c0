-- reap_check.lua: which workers' leases have run out (by the Redis clock),
-- and when the next one will. With a reap lease, each worker returned is
-- hidden from other callers for that long (its deadline in the index moves
-- lease ms ahead), so peers that all woke for the same deaths each take
-- different dead workers: recycling n dead workers costs about n recycle
-- calls in the whole mesh, not n per peer. A caller that dies holding a
-- lease only delays that recycle by the lease.
--
-- KEYS[1] {ns}:workers       ZSET worker id -> lease deadline (ms)
-- ARGV[1] at most this many worker ids (1..1000)
-- ARGV[2] reap lease in ms (0: none, nothing is written)
-- Returns: {now_ms, ms until the earliest deadline still ahead (-1: none),
--           how many workers are registered (live or not yet recycled),
--           worker ids whose deadline has passed...}
--          A listed worker may have renewed since; recycle.lua checks, and
--          puts its true deadline back.
-- Errors: BAD_ARG.
-- Publishes: nothing.
--!include include/now_ms.lua
--!include include/count_arg.lua

local limit, err = count_arg(ARGV[1], 'limit', 1000)
if err then return err end
local lease
lease, err = count_arg(ARGV[2], 'reap lease')
if err then return err end
local now = now_ms()
local out = {now, -1, redis.call('ZCARD', KEYS[1])}
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, limit)
local moved = {}
for _, w in ipairs(due) do
  out[#out + 1] = w
  moved[#moved + 1] = now + lease
  moved[#moved + 1] = w
end
if lease > 0 and #due > 0 then
  -- ZREM first: Redis does not refuse it at the memory limit, and the ZADD
  -- after it then goes through too (see "At the memory limit" in
  -- README.md): dead workers are found, and recycled, when Redis is full
  redis.call('ZREM', KEYS[1], unpack(due))
  redis.call('ZADD', KEYS[1], unpack(moved))
end
local nxt = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
if #nxt > 0 then out[2] = tonumber(nxt[2]) - now end
return out
