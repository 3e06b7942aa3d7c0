-- include/record_head.lua: record_head; needs nothing.

-- The fields of a process record (see include/record.lua) that finishing
-- it needs, if it is a record of `worker` (false otherwise): kind, attempts
-- (a decimal string) and payload. One prefix compare and one match, not a
-- table of all nine fields as unpack_record builds. `wz` is worker .. '\0'.
local function record_head(rec, wz)
  if string.sub(rec, 1, #wz) ~= wz then return false end
  return string.match(rec, '^([^%z]*)%z(%d+)%z%d*%z%d*%z%d*%z%d*%z%d*%z(.*)$', #wz + 1)
end
