-- include/parse_entry.lua: parse_entry; needs nothing.

-- A balance entry ({ns}:moving:<Q> or {ns}:reserved:<Q> value): the worker
-- a task moves to and the Redis time (ms) the entry expires at, "W:ms".
local function parse_entry(v)
  local w, at = string.match(v, '^(.*):(%d+)$')
  return w, tonumber(at or '0')
end
