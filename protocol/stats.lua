-- stats.lua: a worker adds what its handlers did since its last call to the
-- per-minute counts of each queue (the dashboard's charts). Workers call it
-- every few seconds with the sums of that time, never per task.
--
-- KEYS[1] .. KEYS[n] {ns}:stats:<Q>  HASH per queue: "p" .. minute -> processes
--                            finished in that minute (Redis time, whole
--                            minutes since the epoch), "f" .. minute ->
--                            processes failed; ":min" -> the oldest minute
--                            that may still have fields. Expires KEEP
--                            minutes after the last call.
-- ARGV[1] KEEP, how many minutes to keep (1..1440)
-- ARGV[2i], ARGV[2i+1] finished and failed to add for KEYS[i] (whole
--         numbers >= 0)
-- Returns: the minute the counts went to.
-- Errors: BAD_ARG (a count, KEEP, or not two counts per key).
-- Publishes: nothing.
--!include include/now_ms.lua
--!include include/int.lua
--!include include/call_chunked.lua

local keep = tonumber(ARGV[1])
if not keep or keep < 1 or keep > 1440 or keep % 1 ~= 0 then
  return redis.error_reply('BAD_ARG keep must be a whole number of minutes, 1..1440')
end
if #ARGV ~= 2 * #KEYS + 1 then
  return redis.error_reply('BAD_ARG two counts per key')
end
for i = 2, #ARGV do
  local v = tonumber(ARGV[i])
  if not v or v < 0 or v % 1 ~= 0 then
    return redis.error_reply('BAD_ARG counts must be whole numbers >= 0')
  end
end
local minute = math.floor(now_ms() / 60000)
local m = int(minute)
for i, key in ipairs(KEYS) do
  local done, failed = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  if done > 0 then redis.call('HINCRBY', key, 'p' .. m, done) end
  if failed > 0 then redis.call('HINCRBY', key, 'f' .. m, failed) end
  local oldest = tonumber(redis.call('HGET', key, ':min') or m)
  local first_kept = minute - keep + 1
  if oldest < first_kept then
    local gone = {}
    for old = math.max(oldest, first_kept - 1440), first_kept - 1 do
      gone[#gone + 1] = 'p' .. int(old)
      gone[#gone + 1] = 'f' .. int(old)
    end
    call_chunked('HDEL', key, gone)
    oldest = first_kept
  end
  redis.call('HSET', key, ':min', int(oldest))
  redis.call('PEXPIRE', key, keep * 60000)
end
return minute
