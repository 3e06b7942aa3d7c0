-- include/finish_process.lua: finish_begin, finish_process, finish_writes,
-- what finish.lua and finish_results.lua share; needs KEYS[2..6] and ARGV[1],
-- ARGV[3] as those scripts have them, and:
--!include include/record_head.lua
--!include include/call_chunked.lua
--!include include/nudge.lua
--!include include/task_weight.lua
--!include include/add_share.lua
--!include include/forget_weight.lua

-- The state of one finish call, in upvalues (cheaper per process than the
-- fields of a table): W's record prefix, the awaiting key, the ids and
-- payloads to clear, whether any task weighs other than 1 and whether to
-- publish (each read once, when first needed).
local fin_wz, fin_awaiting, fin_gone, fin_seen, fin_attempts, fin_weighted, fin_notify

-- Start a finish call; `awaiting` is the optional {ns}:awaiting:<Q> key
-- (nil: done messages are always published). Returns W's record prefix.
local function finish_begin(awaiting)
  fin_wz, fin_awaiting = ARGV[1] .. '\0', awaiting
  fin_gone, fin_seen, fin_attempts = {}, {}, {}
  return fin_wz
end

-- Finish process `id` whose record (HMGET) is `rec`, if it is W's live
-- process: its task leaves (a persistent one's weight leaves W's held
-- weight and, if the task was W's, the sums), and its payload is published
-- on the done channel (while `awaiting` exists, if given). Returns the
-- payload, or false (not W's, or a repeated id: nothing changes).
local function finish_process(id, rec)
  if not rec or fin_seen[id] then return false end
  fin_seen[id] = true
  local kind, tries, payload = record_head(rec, fin_wz)
  if not kind then return false end
  fin_gone[#fin_gone + 1] = id
  local persistent = kind == 'p'
  if persistent then
    if fin_weighted == nil then fin_weighted = redis.call('HEXISTS', KEYS[6], ':heavy') == 1 end
    local w = fin_weighted and task_weight(KEYS[6], payload) or 1
    -- HDEL before HINCRBY: the first write must be one Redis does not
    -- refuse at the memory limit (see "At the memory limit" in README.md)
    local mine = redis.call('HGET', KEYS[4], payload) == id
    if mine then redis.call('HDEL', KEYS[4], payload) end
    add_share(KEYS[6], 'h' .. ARGV[1], 1 - w)  -- its weight leaves W's held weight
    if mine then
      forget_weight(KEYS[6], payload)  -- the task leaves: its weight leaves the sums
    end
  end
  if persistent or tries ~= '0' then fin_attempts[#fin_attempts + 1] = payload end
  if fin_notify == nil then
    fin_notify = not fin_awaiting or redis.call('EXISTS', fin_awaiting) == 1
  end
  if fin_notify then nudge(ARGV[3], payload) end
  return payload
end

-- The writes for every finished process at once (not one of each per
-- process): their records, their ids in W's held set, their attempt counts.
local function finish_writes()
  call_chunked('HDEL', KEYS[2], fin_gone)
  call_chunked('SREM', KEYS[3], fin_gone)
  call_chunked('HDEL', KEYS[5], fin_attempts)
end
