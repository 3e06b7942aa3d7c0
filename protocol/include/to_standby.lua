-- include/to_standby.lua: to_standby; needs:
--!include include/int.lua
--!include include/call_chunked.lua

-- Keep persistent tasks (payloads) as queued or delayed. Where depends on
-- what costs Redis less memory, never on meaning (a queued persistent task
-- is a member of `standby` or a field of `persistent` with the value ""):
-- a hash of at most 128 fields of at most 64 bytes is compact (a listpack,
-- a ziplist before Redis 7: the defaults of hash-max-listpack-entries and
-- -value), a few bytes per entry, and a set of strings is not before Redis
-- 7.2; a bigger hash is a hash table, which spends an 8-byte value string on
-- each entry that a set does not. So a payload stays in the hash (value "")
-- while the hash is compact and stays so, and goes to the set otherwise.
-- `running`: the payloads are fields of `persistent` now (they stop running).
-- Each payload is also recorded in `unowned` (ZSET payload -> ms), the Redis
-- time since when no process runs it; claim.lua removes it when one does.
local function to_standby(persistent, standby, payloads, running, unowned, now)
  if #payloads == 0 then return end
  local since = {}
  local at = int(now)  -- converted once, not once per payload
  for _, p in ipairs(payloads) do
    since[#since + 1] = at
    since[#since + 1] = p
  end
  call_chunked('ZADD', unowned, since, 2)
  local compact = redis.call('OBJECT', 'ENCODING', persistent) ~= 'hashtable'
  local size = redis.call('HLEN', persistent)
  local in_hash, in_set, gone = {}, {}, {}
  for _, p in ipairs(payloads) do
    if compact and #p <= 64 and (running or size < 128) then
      in_hash[#in_hash + 1] = p
      in_hash[#in_hash + 1] = ''
      if not running then size = size + 1 end
    else
      in_set[#in_set + 1] = p
      if running then gone[#gone + 1] = p end
    end
  end
  call_chunked('HDEL', persistent, gone)
  call_chunked('HSET', persistent, in_hash, 2)
  call_chunked('SADD', standby, in_set)
end
