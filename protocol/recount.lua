-- recount.lua: set a queue's persistent weight sums (share:<Q>'s `:weight`
-- and `:heavy`, see README.md) to what its registry (persistent:<Q> and
-- standby:<Q>) holds, and drop the weights of tasks no longer there. The
-- scripts keep the sums in step with the registry; they drift only when the
-- registry lost tasks behind the mesh's back (evicted by a maxmemory-policy
-- other than noeviction, or deleted): `:weight` above the weight present is
-- how `mesh status` tells persistent tasks that vanished without a cancel.
-- Client.reconcile runs it after it restored the desired tasks.
--
-- KEYS[1] {ns}:persistent:<Q>    HASH persistent payload -> owner process id or ""
-- KEYS[2] {ns}:standby:<Q>       SET of the other queued persistent payloads
-- KEYS[3] {ns}:share:<Q>         HASH weights and capacities (README.md)
-- ARGV[1] queue name Q (for error messages)
-- Returns: {the weight counted before, the weight present}: equal when
--          nothing had drifted (then nothing was written). Safe to run twice.
-- Errors: OOM (Redis is at maxmemory and a sum had drifted: nothing written).
-- Publishes: nothing.
-- Cost: O(persistent tasks of Q + fields of share:<Q>).

local present = {}
local all = redis.call('HGETALL', KEYS[1])  -- HGETALL: the ACL of docs/operating.md has no HKEYS
for i = 1, #all, 2 do present[all[i]] = true end
for _, p in ipairs(redis.call('SMEMBERS', KEYS[2])) do present[p] = true end
local weight, heavy, stale = 0, 0, {}
local fields = redis.call('HGETALL', KEYS[3])
local w = {}
for i = 1, #fields, 2 do
  local f = fields[i]
  if string.sub(f, 1, 1) == 'w' then
    local p = string.sub(f, 2)
    if present[p] then w[p] = tonumber(fields[i + 1]) else stale[#stale + 1] = f end
  end
end
for p in pairs(present) do
  local x = w[p] or 1
  weight = weight + x
  if x ~= 1 then heavy = heavy + 1 end
end
local sums = redis.call('HMGET', KEYS[3], ':weight', ':heavy')
local was = tonumber(sums[1] or '0')
if was == weight and tonumber(sums[2] or '0') == heavy and #stale == 0 then
  return {was, weight}
end
-- HSET first, the write Redis refuses at the memory limit: then nothing is written
redis.call('HSET', KEYS[3], ':weight', weight, ':heavy', heavy)
if weight == 0 then redis.call('HDEL', KEYS[3], ':weight') end
if heavy == 0 then redis.call('HDEL', KEYS[3], ':heavy') end
for i = 1, #stale, 1000 do
  redis.call('HDEL', KEYS[3], unpack(stale, i, math.min(i + 999, #stale)))
end
redis.call('HINCRBY', KEYS[3], ':gen', 1)
return {was, weight}
