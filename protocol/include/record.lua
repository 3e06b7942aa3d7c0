-- include/record.lua: cached_number, unpack_record; needs nothing.

-- A process record (see "Process record" in README.md; written by
-- claim.lua, read here and by include/record_head.lua): nine fields joined by
-- NUL bytes, the payload last:
--   worker \0 kind \0 attempts \0 max_attempts \0 backoff_ms \0 backoff_cap_ms
--   \0 ttl_ms \0 started_ms \0 payload
-- kind: 'p' (a persistent task), 'o' (a one-shot task), 'o' .. level (one
-- with a priority, 1..9), 'g' .. level .. group (a job of that group of the
-- queue, level 0..9: include/group.lua).

-- tonumber(s), remembered in `nums` (a table the caller keeps for one
-- script call): records of one worker share most of their numbers, and
-- converting a string costs Redis ~1k instructions (strtod) where a table
-- lookup costs a few.
local function cached_number(nums, s)
  local v = nums[s]
  if v == nil then
    v = tonumber(s) or false
    nums[s] = v
  end
  return v or nil
end

-- Every field of a process record (see include/record.lua), one match;
-- with `nums` (see cached_number), its numbers converted once per call.
local function unpack_record(rec, nums)
  local w, kind, a, ma, b, bc, ttl, st, payload = string.match(rec,
    '^([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z(.*)$')
  nums = nums or {}
  local group, level = nil, 0
  if string.byte(kind, 1) == 103 then  -- 'g': a group's job, 'g' level group
    level, group = tonumber(string.sub(kind, 2, 2)), string.sub(kind, 3)
  elseif #kind > 1 then
    level = tonumber(string.sub(kind, 2))
  end
  return {
    worker = w,
    kind = kind,
    persistent = (kind == 'p'),
    level = level,
    group = group,
    attempts = cached_number(nums, a),
    max_attempts = cached_number(nums, ma),
    backoff = cached_number(nums, b),
    backoff_cap = cached_number(nums, bc),
    ttl = cached_number(nums, ttl),
    started = cached_number(nums, st),
    payload = payload,
  }
end
