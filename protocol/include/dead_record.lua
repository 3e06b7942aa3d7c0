-- include/dead_record.lua: dead_record; needs:
--!include include/int.lua

-- An entry of a dead-letter list ({ns}:dead:<Q>): six fields joined by NUL
-- bytes, the payload last (it may contain NUL bytes):
--   when_ms \0 attempts \0 worker \0 error \0 kind \0 payload
-- `err` (the last failure) is cut to 2000 bytes and its NUL bytes become
-- spaces; `kind` is the process record's (include/record.lua: 'o', 'o' ..
-- level, 'g' .. level .. group), so that a requeue puts the job back at
-- its priority and into its group.
local function dead_record(now, attempts, worker, err, kind, payload)
  err = string.gsub(string.sub(err or '', 1, 2000), '%z', ' ')
  return int(now) .. '\0' .. int(attempts) .. '\0' .. worker .. '\0' .. err .. '\0' .. kind .. '\0' .. payload
end
