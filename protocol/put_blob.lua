-- put_blob.lua: upload a payload stored out of line (see "Big payloads out
-- of line (version 10)" in README.md), before the call that enqueues its
-- stand-in. A blob that no entry references yet expires after an hour, so an
-- upload whose enqueue never comes leaves nothing for long; the first entry
-- that references it makes it persist (include/blob.lua).
--
-- KEYS[1] {ns}:blob:<sha1hex>    HASH 'd' the payload, 'n' the entries that reference it
-- ARGV[1] the payload (its SHA-1, hex, is the key's last part: the caller's
--         to get right, as every stand-in names it)
-- Returns: 1 if the payload was stored, 0 if it was there already.
-- Errors: OOM (Redis is at maxmemory: nothing was stored).
-- Publishes: nothing.

local new = redis.call('HSETNX', KEYS[1], 'd', ARGV[1])
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
if n <= 0 then redis.call('PEXPIRE', KEYS[1], 3600000) end
return new
