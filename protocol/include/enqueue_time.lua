-- include/enqueue_time.lua: enqt_add (the first enqueue time of each
-- one-shot job of a queue that keeps them: see "Enqueue times" in
-- README.md; include/enqueue_time_drop.lua removes them, and
-- include/enqueue_time_finish.lua for a finish: a script includes only
-- what it calls, every function of its includes being made at every call);
-- needs:
--!include include/now_ms.lua

-- A queue Q keeps enqueue times while its name is in the set {ns}:timed
-- (configure.lua, from its policy's enqueue_times). Then {ns}:enqt:<Q>
-- (ZSET) holds each waiting or running one-shot entry as queued (the
-- payload, or its stand-in: include/blob.lua) -> the Redis time (ms) it was
-- first enqueued (ZADD NX: a payload queued twice keeps the first time). The
-- time stays through claim, retry, hand-back and recycle, and leaves when
-- the job leaves for good (finish, dead-lettering, cancel, delete_queue). A
-- queue that does not keep them pays one SISMEMBER per enqueueing call and
-- one EXISTS per finishing call, nothing per job; its key never exists.
-- The key names are made from the namespace's prefix ({ns}:) of a key given.

-- Payloads list[first..last] of an enqueue into queue `q` (`key`: any key
-- of the namespace) get the time `now` (ms; nil: the Redis clock now)
-- unless they have one, if q keeps enqueue times (one SISMEMBER; nothing
-- more when it does not).
local function enqt_add(key, q, list, first, last, now)
  local prefix = string.match(key, '^(%b{}:)')
  if first > last or redis.call('SISMEMBER', prefix .. 'timed', q) == 0 then return end
  now = now or now_ms()
  local zset = prefix .. 'enqt:' .. q
  for i = first, last, 2000 do
    local args = {}
    for j = i, math.min(i + 1999, last) do
      args[#args + 1] = now
      args[#args + 1] = list[j]
    end
    redis.call('ZADD', zset, 'NX', unpack(args))
  end
end
