-- serve.lua: a worker starts serving a queue (it may then claim from it).
--
-- KEYS[1] {ns}:worker:<W>   heartbeat key
-- KEYS[2] {ns}:serves:<W>   SET of the queues W serves
-- KEYS[3] {ns}:queues       SET of known queue names
-- KEYS[4] {ns}:servers:<Q>  SET of the workers that serve Q
-- ARGV[1] worker id W
-- ARGV[2] incarnation
-- ARGV[3] queue name Q
-- Returns: 1.
-- Errors: FENCED (W holds no lease).
-- Publishes: nothing.
--!include lib.lua

local err = lease_error(KEYS[1], ARGV[1], ARGV[2])
if err then return err end
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('SADD', KEYS[4], ARGV[1])
return 1
