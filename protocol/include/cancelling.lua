-- include/cancelling.lua: find_processes, worker_keys, cancel_found; needs:
--!include include/record.lua
--!include include/nudge.lua
--!include include/group.lua

-- Running processes of `procs` whose payload is `payload` (all of them when
-- payload is false): a list of {id, worker, group (nil: none)}.
local function find_processes(procs, payload)
  local found = {}
  local all = redis.call('HGETALL', procs)
  for i = 1, #all, 2 do
    local rec = all[i + 1]
    if payload == false or #payload == 0 or string.sub(rec, -#payload) == payload then
      local r = unpack_record(rec)
      if payload == false or r.payload == payload then
        found[#found + 1] = {all[i], r.worker, r.group}
      end
    end
  end
  return found
end

-- The worker keys a cancelling script was given (`keys` and `argv` are its
-- KEYS and ARGV): worker ids are argv[a + j] and their {held, inbox} keys
-- keys[k + 2j - 1], keys[k + 2j], j = 1..n.
-- Returns the keys by worker, and, when a process in `found` runs on a
-- worker that is not among them, the reply the script must return at once
-- ({1, missing worker ids...}: the caller calls again with their keys).
local function worker_keys(found, keys, argv, a, k, n)
  local wkeys, missing, seen = {}, {1}, {}
  for j = 1, n do
    wkeys[argv[a + j]] = {keys[k + 2 * j - 1], keys[k + 2 * j]}
  end
  for _, f in ipairs(found) do
    if not wkeys[f[2]] and not seen[f[2]] then
      seen[f[2]] = true
      missing[#missing + 1] = f[2]
    end
  end
  if #missing > 1 then return wkeys, missing end
  return wkeys, nil
end

-- Cancel the running processes in `found`: drop their records, take them out
-- of their worker's held set, put their ids in the worker's durable inbox and
-- publish them on the worker's cancel channel. `wkeys[worker]` is
-- {held key, inbox key}.
local function cancel_found(found, procs, wkeys, cancel_prefix)
  local order, counts = {}, {}
  for _, f in ipairs(found) do
    local id, worker = f[1], f[2]
    redis.call('HDEL', procs, id)
    redis.call('SREM', wkeys[worker][1], id)
    redis.call('SADD', wkeys[worker][2], id)
    nudge(cancel_prefix .. worker, id)
    local g = f[3]
    if g then group_lib().tally(order, counts, g) end  -- a group's job: its slot is free
  end
  if #order > 0 then
    local groups = group_lib()
    groups.release_many(groups.keys_of(procs, 'procs'), order, counts)
  end
end
