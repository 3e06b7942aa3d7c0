-- peek.lua: a page of a queue's entries as previews: each entry's first
-- bytes and its size, never the whole of it, so that listing jobs of 64 MiB
-- each sends a few hundred bytes per job. The entries are read one at a time
-- inside Redis (LINDEX, ZRANGE i i, HGET). Writes nothing.
--
-- KEYS[1]   the entries: a list ({ns}:queue:<Q>, {ns}:dead:<Q>), a sorted set
--           ({ns}:prio:<Q>, {ns}:delayed:<Q>) or a hash ({ns}:procs:<Q>)
-- KEYS[2..6] optional, all or none but KEYS[6]: {ns}:persistent:<Q>,
--           {ns}:standby:<Q>, {ns}:attempts:<Q>, {ns}:unowned:<Q>, and
--           {ns}:delayed_prio:<Q>: with them, each entry's payload is also
--           looked up in them
-- KEYS[7]   optional (with KEYS[2..6]): {ns}:enqt:<Q>, the enqueue times
--           of one-shot jobs (include/enqueue_time.lua), looked up for
--           "since" where KEYS[5] has none
-- ARGV[1]   the shape of KEYS[1]: "list", "zset" or "hash"
-- ARGV[2], ARGV[3]  first and last index (list, zset; inclusive, from 0)
-- ARGV[4]   preview bytes: how much of the payload to return (0..65536)
-- ARGV[5]   bytes before the payload in an entry (a priority member's 16)
-- ARGV[6]   NUL-separated fields before the payload, after those bytes (a
--           process record's 8, a dead-letter record's 5)
-- ARGV[7]   a budget in bytes (0: none): once the entries read add up to it,
--           the script stops and returns those read so far (at least one),
--           so that one call of a page of 64 MiB payloads holds Redis up for
--           a bounded time; the caller calls again for the rest
-- ARGV[8..] with "hash": the fields to read, in order
-- Returns: {total, entry, ...}: total is the entry count of KEYS[1] (fewer
--          entries than asked for: the budget ran out, or KEYS[1] ended); an
--          entry is {head, size, fingerprint, score, persistent, attempts,
--          since, level}: head is the entry up to the payload and the first
--          ARGV[4] bytes of the payload; size the payload's whole size;
--          fingerprint the first 16 hex digits of the SHA-1 of
--          size .. "\0" .. first 1024 bytes .. "\0" .. last 1024 bytes of
--          the payload (a short key to find it again); score the sorted
--          set's score (else false); persistent 1 if the payload is in
--          KEYS[2] or KEYS[3] (else 0); attempts KEYS[4]'s value, since
--          KEYS[5]'s score (else KEYS[7]'s), level KEYS[6]'s value (each false when absent or
--          not asked). A hash field that is gone answers false in its place.
-- Errors: BAD_ARG (a shape, index or count that is not one of the above).
-- Publishes: nothing.

local shape, n = ARGV[1], tonumber(ARGV[4])
local skip, fields = tonumber(ARGV[5]), tonumber(ARGV[6])
if (shape ~= 'list' and shape ~= 'zset' and shape ~= 'hash') or not n or n < 0
    or n > 65536 or not skip or skip < 0 or not fields or fields < 0 then
  return redis.error_reply('BAD_ARG peek: shape, preview bytes, skip or fields')
end
local first, last = tonumber(ARGV[2]), tonumber(ARGV[3])
if shape ~= 'hash' and (not first or not last or first < 0) then
  return redis.error_reply('BAD_ARG peek: first and last index')
end
-- the lookups are skipped for keys that are empty: a payload of 64 MiB
-- passed to a command is copied once more
local budget = tonumber(ARGV[7])
if not budget or budget < 0 then
  return redis.error_reply('BAD_ARG peek: budget')
end
local spent = 0
local extras = #KEYS >= 5
local look = {}
if extras then
  look[2] = redis.call('HLEN', KEYS[2]) > 0
  look[3] = redis.call('SCARD', KEYS[3]) > 0
  look[4] = redis.call('HLEN', KEYS[4]) > 0
  look[5] = redis.call('ZCARD', KEYS[5]) > 0
  look[6] = KEYS[6] ~= nil and redis.call('HLEN', KEYS[6]) > 0
  look[7] = KEYS[7] ~= nil and redis.call('EXISTS', KEYS[7]) == 1
end

local function fingerprint(p)
  return string.sub(redis.sha1hex(#p .. '\0' .. string.sub(p, 1, 1024) .. '\0'
    .. string.sub(p, -1024)), 1, 16)
end

local function entry(e, score)
  spent = spent + #e
  local at = skip
  for _ = 1, fields do
    at = string.find(e, '\0', at + 1, true)
    if not at then
      return {string.sub(e, 1, skip + n), 0, '', score or false, 0, false, false, false}
    end
  end
  local p = at == 0 and e or string.sub(e, at + 1)
  local out = {string.sub(e, 1, at + n), #p, fingerprint(p), score or false, 0, false, false,
               false}
  if extras then
    if (look[2] and redis.call('HEXISTS', KEYS[2], p) == 1)
        or (look[3] and redis.call('SISMEMBER', KEYS[3], p) == 1) then
      out[5] = 1
    end
    if look[4] then out[6] = redis.call('HGET', KEYS[4], p) end
    if look[5] then out[7] = redis.call('ZSCORE', KEYS[5], p) end
    if look[6] then out[8] = redis.call('HGET', KEYS[6], p) end
    if look[7] and not out[7] then out[7] = redis.call('ZSCORE', KEYS[7], p) end
  end
  return out
end

local out = {}
if shape == 'list' then
  out[1] = redis.call('LLEN', KEYS[1])
  for i = first, math.min(last, out[1] - 1) do
    if budget > 0 and spent >= budget then break end
    local e = redis.call('LINDEX', KEYS[1], i)
    if e then out[#out + 1] = entry(e) end
  end
elseif shape == 'zset' then
  out[1] = redis.call('ZCARD', KEYS[1])
  for i = first, math.min(last, out[1] - 1) do
    if budget > 0 and spent >= budget then break end
    local got = redis.call('ZRANGE', KEYS[1], i, i, 'WITHSCORES')
    if got[1] then out[#out + 1] = entry(got[1], got[2]) end
  end
else
  out[1] = redis.call('HLEN', KEYS[1])
  for i = 8, #ARGV do
    if budget > 0 and spent >= budget then break end
    local e = redis.call('HGET', KEYS[1], ARGV[i])
    out[#out + 1] = e and entry(e) or false
  end
end
return out
