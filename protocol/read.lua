-- read.lua: run several read commands in one step and answer with their
-- replies: one consistent view of several keys, as MULTI/EXEC gives, but one
-- that Redis also runs at the memory limit (it refuses every command queued
-- in a MULTI when used memory is above maxmemory; a script that only reads
-- is never refused: see "At the memory limit" in README.md). Writes nothing.
--
-- KEYS[1], KEYS[2], ... every key the commands read (each command's first
--           argument, but for TIME, which takes none)
-- ARGV[1], ARGV[2], ... the commands one after another, each as its argument
--           count n, its name, then its n arguments: "1", "LLEN", key, "0",
--           "TIME", ...
-- Returns: one reply per command, in order (a missing value is nil, as the
--          command itself would answer).
-- Errors: BAD_ARG (a command that is not one of the reads below, a key not
--         in KEYS, an argument count that runs past ARGV); a command's own
--         error (WRONGTYPE) fails the whole call.
-- Publishes: nothing.

local reads = {TIME = 0, LLEN = 1, LRANGE = 1, ZCARD = 1, ZCOUNT = 1, ZRANGE = 1,
               ZRANGEBYSCORE = 1, ZSCORE = 1, HLEN = 1, HGET = 1, HMGET = 1, HGETALL = 1,
               HEXISTS = 1, SCARD = 1, SMEMBERS = 1, SISMEMBER = 1, GET = 1,
               PTTL = 1, EXISTS = 1}
local declared = {}
for _, k in ipairs(KEYS) do declared[k] = true end
local out, i = {}, 1
while i <= #ARGV do
  local n, name = tonumber(ARGV[i]), ARGV[i + 1]
  if not n or not name or i + 1 + n > #ARGV then
    return redis.error_reply('BAD_ARG command ' .. (#out + 1) .. ' runs past the arguments')
  end
  local cmd = string.upper(name)
  local keyed = reads[cmd]
  if not keyed then
    return redis.error_reply('BAD_ARG ' .. name .. ' is not a read this script runs')
  end
  if keyed == 1 and (n < 1 or not declared[ARGV[i + 2]]) then
    return redis.error_reply('BAD_ARG command ' .. (#out + 1) .. ' reads a key not in KEYS')
  end
  out[#out + 1] = redis.call(cmd, unpack(ARGV, i + 2, i + 1 + n))
  i = i + 2 + n
end
return out
