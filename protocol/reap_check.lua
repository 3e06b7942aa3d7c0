-- reap_check.lua: which workers' leases have run out, and when the next one
-- will. Read-only; the Redis clock decides.
--
-- KEYS[1] {ns}:workers       ZSET worker id -> lease deadline (ms)
-- ARGV[1] at most this many worker ids (1..1000)
-- Returns: {now_ms, ms until the earliest deadline still ahead (-1: none),
--           worker ids whose deadline has passed...}
--          A listed worker may have renewed since; recycle.lua checks.
-- Errors: BAD_ARG.
-- Publishes: nothing.
--!include lib.lua

local limit, err = count_arg(ARGV[1], 'limit', 1000)
if err then return err end
local now = now_ms()
local out = {now, -1}
for _, w in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, limit)) do
  out[#out + 1] = w
end
local nxt = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
if #nxt > 0 then out[2] = tonumber(nxt[2]) - now end
return out
