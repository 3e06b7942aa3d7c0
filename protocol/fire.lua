-- fire.lua: fire due ticks of periodic tasks: each enqueues one one-shot
-- copy of its payload at the back of its queue, and its next tick is set.
-- Compare-and-set on the tick: a tick fires only if the schedule is still
-- due at exactly the tick the caller read, so however many peers try, each
-- tick fires once across the mesh. The caller computes the next tick (cron
-- needs a parser); it must be after the tick fired.
--
-- KEYS[1] {ns}:schedules         ZSET schedule id -> next tick (ms)
-- KEYS[2] {ns}:schedule_specs    HASH schedule id -> spec
-- KEYS[3] {ns}:queues            SET of known queue names
-- then per schedule i = 1..n, four keys of its queue Q_i:
--   {ns}:queue:<Q>, {ns}:persistent:<Q>, {ns}:standby:<Q>, {ns}:idle:<Q>
-- ARGV[1] prefix of wake channels ({ns}:wake:)
-- then per schedule i: its id (Q, NUL, payload), the tick read (ms), the
--   next tick (ms)
-- Returns: per schedule, 1 if this call fired its tick, 0 if not (fired by
--          another peer already, removed, replaced, or not due by the Redis
--          clock); 2 if the tick passed but the payload is a persistent task
--          of Q now (nothing enqueued, the next tick set).
-- Errors: BAD_ARG (key or argument count, a next tick not after the tick),
--         OOM (Redis is at maxmemory: nothing fired, the ticks stay due).
-- Times: while Q keeps enqueue times, each copy's first enqueue time
--        (include/enqueue_time.lua).
-- Publishes: Q on the wake channels of up to two idle servers of Q per copy
--            enqueued (see include/wake_idle.lua).
--!include include/now_ms.lua
--!include include/is_persistent.lua
--!include include/wake_idle.lua
--!include include/enqueue_time.lua

local n = (#ARGV - 1) / 3
if n ~= math.floor(n) or #KEYS ~= 3 + 4 * n then
  return redis.error_reply('BAD_ARG expected 3 arguments and 4 keys per schedule')
end
for i = 1, n do
  local a = 2 + 3 * (i - 1)
  local tick, nxt = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  if not tick or not nxt or nxt <= tick then
    return redis.error_reply('BAD_ARG the next tick must be after the tick fired')
  end
end
local now = now_ms()
local out = {}
for i = 1, n do
  local a = 2 + 3 * (i - 1)
  local k = 3 + 4 * (i - 1)
  local id, tick = ARGV[a], tonumber(ARGV[a + 1])
  local score = redis.call('ZSCORE', KEYS[1], id)
  local fired = 0
  if score and tonumber(score) == tick and tick <= now then
    local cut = string.find(id, '\0', 1, true)
    local q, payload = string.sub(id, 1, cut - 1), string.sub(id, cut + 1)
    if redis.call('EXISTS', KEYS[k + 2], KEYS[k + 3]) > 0
        and is_persistent(KEYS[k + 2], KEYS[k + 3], payload) then
      fired = 2
    else
      redis.call('SADD', KEYS[3], q)  -- first: refused at the memory limit (as in enqueue.lua)
      wake_idle(KEYS[k + 4], ARGV[1], q, 1)
      redis.call('RPUSH', KEYS[k + 1], payload)
      enqt_add(KEYS[3], q, {payload}, 1, 1, now)
      fired = 1
    end
    redis.call('ZADD', KEYS[1], 'XX', ARGV[a + 2], id)
  end
  out[i] = fired
end
return out
