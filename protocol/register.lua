-- register.lua: a worker joins the mesh under a new id.
--
-- KEYS[1] {ns}:worker:<W>   heartbeat key (STRING, value = incarnation, PX ttl)
-- KEYS[2] {ns}:workers      ZSET worker id -> lease deadline (ms, Redis clock)
-- KEYS[3] {ns}:info         HASH worker id -> worker description (opaque to Lua)
-- KEYS[4] {ns}:version      STRING protocol version of the namespace
-- ARGV[1] worker id W
-- ARGV[2] incarnation: a random string, proof of identity for later calls
-- ARGV[3] ttl in ms
-- ARGV[4] worker description (JSON written by the client). A JSON object
--         (first byte "{") gets "started": the Redis time in seconds (3
--         decimals) as its first member, in this same step; anything else
--         is stored as is
-- ARGV[5] protocol version of the caller
-- Returns: the Redis time in ms.
-- Errors: VERSION (the namespace holds another protocol version),
--         DUPLICATE_WORKER (W is live, or dead and not yet recycled),
--         BAD_ARG (ttl).
-- Publishes: nothing.
--!include include/now_ms.lua
--!include include/count_arg.lua

local ttl, err = count_arg(ARGV[3], 'ttl')
if err then return err end
if ttl < 1 then return redis.error_reply('BAD_ARG ttl must be >= 1 ms') end
local version = redis.call('GET', KEYS[4])
if version and version ~= ARGV[5] then
  return redis.error_reply('VERSION namespace holds protocol version ' .. version
    .. ', this client speaks ' .. ARGV[5])
end
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return redis.error_reply('DUPLICATE_WORKER worker id ' .. ARGV[1] .. ' is in use')
end

local now = now_ms()
local desc = ARGV[4]
if string.sub(desc, 1, 1) == '{' then
  local rest = string.sub(desc, 2)
  local sep = string.find(rest, '^%s*}') and '' or ','
  desc = '{"started":' .. string.format('%.3f', now / 1000) .. sep .. rest
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], desc)
if not version then redis.call('SET', KEYS[4], ARGV[5]) end
return now
