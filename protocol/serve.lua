-- serve.lua: a worker starts serving a queue (it may then claim from it),
-- with a capacity: its part of the fair share (include/fair_share.lua). Serving
-- again changes the capacity.
--
-- KEYS[1] {ns}:worker:<W>   heartbeat key
-- KEYS[2] {ns}:serves:<W>   SET of the queues W serves
-- KEYS[3] {ns}:queues       SET of known queue names
-- KEYS[4] {ns}:servers:<Q>  SET of the workers that serve Q
-- KEYS[5] {ns}:share:<Q>    HASH weights and capacities (README.md)
-- ARGV[1] worker id W
-- ARGV[2] incarnation
-- ARGV[3] queue name Q
-- ARGV[4] W's capacity on Q, a whole number from 1 to 1000000
-- Returns: 1.
-- Errors: FENCED (W holds no lease), BAD_ARG (capacity).
-- Publishes: nothing.
--!include include/lease_error.lua
--!include include/set_capacity.lua

local cap = tonumber(ARGV[4])
if not cap or cap < 1 or cap > 1000000 or cap ~= math.floor(cap) then
  return redis.error_reply('BAD_ARG capacity must be a whole number from 1 to 1000000')
end
local err = lease_error(KEYS[1], ARGV[1], ARGV[2])
if err then return err end
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[3])
local was = 0  -- not a server yet
if redis.call('SADD', KEYS[4], ARGV[1]) == 0 then
  was = tonumber(redis.call('HGET', KEYS[5], 'c' .. ARGV[1]) or '1')
end
set_capacity(KEYS[5], ARGV[1], cap, was)
return 1
