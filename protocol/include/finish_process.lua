-- include/finish_process.lua: finish_begin, finish_process, finish_writes,
-- what finish.lua and finish_results.lua share; needs KEYS[2..6] and ARGV[1],
-- ARGV[3] as those scripts have them, and:
--!include include/record_head.lua
--!include include/call_chunked.lua
--!include include/nudge.lua
--!include include/task_weight.lua
--!include include/add_share.lua
--!include include/forget_weight.lua

-- The state of one finish call; `awaiting` is the optional {ns}:awaiting:<Q>
-- key (nil: done messages are always published).
local function finish_begin(awaiting)
  return {wz = ARGV[1] .. '\0', awaiting = awaiting, gone = {}, seen = {}, attempts = {}}
end

-- Finish process `id` whose record (HMGET) is `rec`, if it is W's live
-- process: its task leaves (a persistent one's weight leaves W's held
-- weight and, if the task was W's, the sums), and its payload is published
-- on the done channel (while `awaiting` exists, if given). Returns the
-- payload, or false (not W's, or a repeated id: nothing changes).
local function finish_process(f, id, rec)
  if not rec or f.seen[id] then return false end
  f.seen[id] = true
  local kind, tries, payload = record_head(rec, f.wz)
  if not kind then return false end
  f.gone[#f.gone + 1] = id
  local persistent = kind == 'p'
  if persistent then
    -- whether any task of Q weighs other than 1: read at the first persistent one
    if f.weighted == nil then f.weighted = redis.call('HEXISTS', KEYS[6], ':heavy') == 1 end
    local w = f.weighted and task_weight(KEYS[6], payload) or 1
    -- HDEL before HINCRBY: the first write must be one Redis does not
    -- refuse at the memory limit (see "At the memory limit" in README.md)
    local mine = redis.call('HGET', KEYS[4], payload) == id
    if mine then redis.call('HDEL', KEYS[4], payload) end
    add_share(KEYS[6], 'h' .. ARGV[1], 1 - w)  -- its weight leaves W's held weight
    if mine then
      forget_weight(KEYS[6], payload)  -- the task leaves: its weight leaves the sums
    end
  end
  if persistent or tries ~= '0' then f.attempts[#f.attempts + 1] = payload end
  -- whether to publish done messages: read at the first finished process
  if f.notify == nil then f.notify = not f.awaiting or redis.call('EXISTS', f.awaiting) == 1 end
  if f.notify then nudge(ARGV[3], payload) end
  return payload
end

-- The writes for every finished process at once (not one of each per
-- process): their records, their ids in W's held set, their attempt counts.
local function finish_writes(f)
  call_chunked('HDEL', KEYS[2], f.gone)
  call_chunked('SREM', KEYS[3], f.gone)
  call_chunked('HDEL', KEYS[5], f.attempts)
end
