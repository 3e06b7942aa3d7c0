-- dead.lua: work on a queue's dead letters: put them back at the back of the
-- queue with their attempts reset (mode "requeue"), or drop them (mode
-- "purge"); all of them, or those whose payload is one of ARGV[4..].
--
-- KEYS[1] {ns}:dead:<Q>          LIST of dead-letter records (include/dead_record.lua)
-- KEYS[2] {ns}:queue:<Q>         LIST of queued payloads
-- KEYS[3] {ns}:attempts:<Q>      HASH payload -> failed attempts
-- KEYS[4] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[5] {ns}:standby:<Q>       SET of persistent payloads queued or delayed (those not kept as "" in the hash)
-- KEYS[6] {ns}:idle:<Q>          SET of idle servers of Q (see include/wake_idle.lua)
-- ARGV[1] queue name Q
-- ARGV[2] prefix of wake channels ({ns}:wake:), the worker id is appended
-- ARGV[3] mode: "requeue" or "purge"
-- ARGV[4..] payloads to act on; none: every dead letter of Q
-- Returns: {records requeued or purged, records left alone because their
--          payload has become a persistent task of Q (requeue only)}.
--          Running it twice: the second run finds nothing to do.
-- Errors: BAD_ARG (mode).
-- Blobs: a purged stand-in's blob loses a reference (include/blob.lua); a
--        requeued one keeps it (the dead copy becomes the queued copy).
-- Publishes: after a requeue, Q on the wake channels of up to (tasks
--            requeued) + 1 idle servers of Q.
--!include include/is_persistent.lua
--!include include/call_chunked.lua
--!include include/wake_idle.lua
--!include include/blob.lua

local mode = ARGV[3]
if mode ~= 'requeue' and mode ~= 'purge' then
  return redis.error_reply('BAD_ARG mode must be "requeue" or "purge"')
end
local all = #ARGV == 3
local wanted = {}
for i = 4, #ARGV do wanted[ARGV[i]] = true end
local has_persistent = mode == 'requeue' and redis.call('EXISTS', KEYS[4], KEYS[5]) > 0

local recs = redis.call('LRANGE', KEYS[1], 0, -1)
local keep, take, refused = {}, {}, 0
for _, rec in ipairs(recs) do
  local pos = 1
  for _ = 1, 4 do pos = string.find(rec, '\0', pos, true) + 1 end
  local payload = string.sub(rec, pos)
  if all or wanted[payload] then
    if has_persistent and is_persistent(KEYS[4], KEYS[5], payload) then
      refused = refused + 1
      keep[#keep + 1] = rec
    else
      take[#take + 1] = payload
    end
  else
    keep[#keep + 1] = rec
  end
end
if #take == 0 then return {0, refused} end
if mode == 'requeue' then
  -- before the first write (see wake_idle)
  wake_idle(KEYS[6], ARGV[2], ARGV[1], #take)
end
redis.call('DEL', KEYS[1])
call_chunked('RPUSH', KEYS[1], keep)
if mode == 'requeue' then
  call_chunked('HDEL', KEYS[3], take)
  call_chunked('RPUSH', KEYS[2], take)
else
  local prefix = nil
  for _, p in ipairs(take) do
    if blob_is(p) then
      prefix = prefix or blob_prefix(KEYS[1])
      blob_unref(prefix, p)
    end
  end
end
return {#take, refused}
