-- configure.lua: set the policy of a queue, which every worker serving it
-- applies (read by the workers at start_work and on every heartbeat).
--
-- The policy of Q is one JSON object, the field Q of {ns}:policy, with the
-- whole-number fields max_attempts (0: no limit), backoff_ms, backoff_max_ms,
-- timeout_ms (0: none), result_ttl_ms (0: results are not kept), rate_limit
-- (claims per rate_period_ms across the mesh; 0: no limit), enqueue_times
-- (1: keep each one-shot job's first enqueue time, 0: not; see "Enqueue
-- times" in README.md: the queue's name is in the set {ns}:timed exactly
-- while it is 1, and {ns}:enqt:<Q> is deleted when it is 0), and the
-- string source: who wrote it ("configure", or "worker <W>" for a worker
-- whose start_work options became the policy of a queue that had none).
--
-- KEYS[1] {ns}:policy            HASH queue name -> policy (JSON)
-- KEYS[2] {ns}:queues            SET of known queue names
-- ARGV[1] queue name Q
-- ARGV[2] mode: "set" (the fields given replace those stored; the others
--         keep their stored value, or their default), "default" (the fields
--         given become the policy only if Q has none), or "clear" (Q has no
--         policy any more; no fields)
-- ARGV[3] source (see above)
-- ARGV[4..] field name, value, field name, value, ...
-- Returns: the policy stored afterwards (JSON), or false after "clear".
--          Running it twice stores the same policy.
-- Errors: BAD_ARG (mode, an unknown field, a value that is not a whole
--         number >= 0, backoff_ms > backoff_max_ms).
-- Publishes: nothing.
--!include include/count_arg.lua

local mode = ARGV[2]
if mode ~= 'set' and mode ~= 'default' and mode ~= 'clear' then
  return redis.error_reply('BAD_ARG mode must be "set", "default" or "clear"')
end
local defaults = {max_attempts = 5, backoff_ms = 1000, backoff_max_ms = 60000, timeout_ms = 0,
                  result_ttl_ms = 0, rate_limit = 0, rate_period_ms = 1000, enqueue_times = 0}
local given = {}
for i = 4, #ARGV - 1, 2 do
  local f = ARGV[i]
  if defaults[f] == nil then
    return redis.error_reply('BAD_ARG unknown policy field ' .. f)
  end
  local v, err = count_arg(ARGV[i + 1], f, f == 'enqueue_times' and 1 or nil)
  if err then return err end
  given[f] = v
end
if (#ARGV - 3) % 2 ~= 0 then
  return redis.error_reply('BAD_ARG policy fields come in name, value pairs')
end
local prefix = string.match(KEYS[2], '^(%b{}:)')
local function untimed()
  redis.call('SREM', prefix .. 'timed', ARGV[1])
  redis.call('DEL', prefix .. 'enqt:' .. ARGV[1])
end
if mode == 'clear' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  untimed()
  return false
end
local stored = redis.call('HGET', KEYS[1], ARGV[1])
if stored and mode == 'default' then return stored end
local p = {}
if stored then p = cjson.decode(stored) end
for f, v in pairs(defaults) do
  if given[f] ~= nil then p[f] = given[f] elseif p[f] == nil then p[f] = v end
end
if p.rate_period_ms < 1 then
  return redis.error_reply('BAD_ARG rate_period_ms must be >= 1')
end
if p.backoff_ms > p.backoff_max_ms then
  return redis.error_reply('BAD_ARG backoff_ms must not be above backoff_max_ms')
end
p.source = ARGV[3]
local out = cjson.encode(p)
redis.call('HSET', KEYS[1], ARGV[1], out)
redis.call('SADD', KEYS[2], ARGV[1])
if p.enqueue_times == 1 then redis.call('SADD', prefix .. 'timed', ARGV[1]) else untimed() end
return out
