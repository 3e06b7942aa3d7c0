-- finish_results.lua: finish.lua for a queue that keeps results (its policy
-- has a result TTL): report processes as finished, and keep what each
-- handler returned, under a key of its payload, for ARGV[4] ms.
--
-- KEYS[1] {ns}:worker:<W>        heartbeat key
-- KEYS[2] {ns}:procs:<Q>         HASH process id -> process record
-- KEYS[3] {ns}:held:<W>:<Q>      SET of W's process ids on Q
-- KEYS[4] {ns}:persistent:<Q>    HASH persistent payload -> owner process id (running) or "" (queued: see include/to_standby.lua)
-- KEYS[5] {ns}:attempts:<Q>      HASH payload -> failed attempts
-- KEYS[6] {ns}:share:<Q>         HASH weights and capacities (README.md): a
--                                finished persistent task's weight leaves it
-- KEYS[6 + i] {ns}:result:<H>:<Q> for each process i = 1..n: STRING, the
--         result record of its payload (H: the SHA-1 of the payload, hex)
-- KEYS[7 + n] (optional) {ns}:awaiting:<Q>  STRING that exists while
--         someone awaits Q's done messages (as in finish.lua KEYS[7])
-- ARGV[1] worker id W
-- ARGV[2] incarnation
-- ARGV[3] the done channel of Q ({ns}:done:<Q>)
-- ARGV[4] result ttl in ms (>= 1)
-- ARGV[5 + 3(i-1)], ARGV[6 + 3(i-1)], ARGV[7 + 3(i-1)] for each process i:
--         its id, "v" (a value) or "n" (None), the value
-- Returns: per process id, 1 if it was W's live process and is now finished
--          (its result is kept), 0 if not (then nothing changes for it; if
--          W holds no lease nothing changes at all).
-- Errors: BAD_ARG (ttl, argument or key count).
-- Times: as finish.lua (include/enqueue_time.lua).
-- Publishes: the payload of each finished process on ARGV[3] (after its
--            result is kept; with KEYS[7 + n]: only if KEYS[7 + n] exists).
-- The result record (a STRING with PX ttl): kind \0 when_ms \0 worker \0
-- length of value \0 value payload; kind "v" or "n"; value and payload may
-- hold NUL bytes; the payload is kept so that a reader can check that the
-- record is of its payload.
--!include include/now_ms.lua
--!include include/int.lua
--!include include/count_arg.lua
--!include include/lease_error.lua
--!include include/hmget_all.lua
--!include include/finish_process.lua

local ttl, err = count_arg(ARGV[4], 'result ttl')
if err then return err end
if ttl < 1 then return redis.error_reply('BAD_ARG result ttl must be >= 1') end
local n = (#ARGV - 4) / 3
if n ~= math.floor(n) or (#KEYS ~= 6 + n and #KEYS ~= 7 + n) then
  return redis.error_reply('BAD_ARG expected 3 arguments and 1 key per process')
end
local out = {}
if lease_error(KEYS[1], ARGV[1], ARGV[2]) then
  for i = 1, n do out[i] = 0 end
  return out
end
local now = int(now_ms())
-- The awaiting key, if given (see the check of #KEYS above).
local wz = finish_begin(ARGV[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7 + n], ARGV[3], true)
-- As finish.lua (include/finish_process.lua); then one SET per kept result.
local ids = {}
for i = 1, n do ids[i] = ARGV[2 + 3 * i] end
local recs = hmget_all(KEYS[2], ids)
local results = {}
for i, id in ipairs(ids) do
  local a = 2 + 3 * i
  local payload = finish_process(id, recs[i])
  if payload then
    local kind_v = ARGV[a + 1] == 'v' and 'v' or 'n'
    local value = ARGV[a + 2]
    results[#results + 1] = {KEYS[6 + i], kind_v .. '\0' .. now .. '\0' .. wz
      .. string.format('%d', #value) .. '\0' .. value .. payload}
  end
  out[i] = payload and 1 or 0
end
finish_writes()
-- The results last, after the process records left: SET is refused at the
-- memory limit only as a script's first write, so a full Redis still
-- finishes (and stores the results: see "At the memory limit" in README.md)
for _, r in ipairs(results) do redis.call('SET', r[1], r[2], 'PX', ttl) end
return out
