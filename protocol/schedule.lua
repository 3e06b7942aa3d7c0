-- schedule.lua: add, replace (mode "add") or remove (mode "remove") the
-- periodic task (Q, payload): unique per (queue, payload). Each tick of it
-- enqueues one one-shot copy of the payload (see fire.lua).
--
-- KEYS[1] {ns}:schedules         ZSET schedule id -> next tick (ms, Redis clock)
-- KEYS[2] {ns}:schedule_specs    HASH schedule id -> spec
-- KEYS[3] {ns}:queues            SET of known queue names
-- ARGV[1] mode: "add" or "remove"
-- ARGV[2] queue name Q
-- ARGV[3] payload
-- ARGV[4] (add) the spec: "every <ms>" (a tick every ms, the first one ms
--         from now) or "cron <expression>" (evaluated by the peers, in UTC)
-- ARGV[5] (add) the first tick: ms since the epoch (Redis clock), or "" for
--         now + the period of an "every" spec
-- A schedule id is Q, a NUL byte and the payload.
-- Returns: mode add: {1 if new (0 if it replaced one), the first tick};
--          mode remove: 1 if it existed, else 0. Running either twice
--          leaves the same state.
-- Errors: BAD_ARG (mode, spec, tick).
-- Publishes: nothing (peers re-read the first tick every heartbeat interval).
--!include include/now_ms.lua
--!include include/int.lua
--!include include/count_arg.lua

local mode = ARGV[1]
local id = ARGV[2] .. '\0' .. ARGV[3]
if mode == 'remove' then
  local n = redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  return n
end
if mode ~= 'add' then return redis.error_reply('BAD_ARG mode must be "add" or "remove"') end
local spec = ARGV[4]
local first
if string.sub(spec, 1, 6) == 'every ' then
  local every, err = count_arg(string.sub(spec, 7), 'period')
  if err then return err end
  if every < 1 then return redis.error_reply('BAD_ARG period must be >= 1 ms') end
  first = now_ms() + every
elseif string.sub(spec, 1, 5) == 'cron ' and #spec > 5 then
  first = nil
else
  return redis.error_reply('BAD_ARG spec must be "every <ms>" or "cron <expression>"')
end
if ARGV[5] ~= '' then
  local at, err = count_arg(ARGV[5], 'first tick')
  if err then return err end
  first = at
end
if not first then return redis.error_reply('BAD_ARG a cron schedule needs its first tick') end
local new = redis.call('ZADD', KEYS[1], int(first), id)
redis.call('HSET', KEYS[2], id, spec)
redis.call('SADD', KEYS[3], ARGV[2])
return {new, first}
