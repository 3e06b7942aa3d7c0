-- include/dead_record.lua: dead_record; needs:
--!include include/int.lua

-- An entry of a dead-letter list ({ns}:dead:<Q>): five fields joined by NUL
-- bytes, the payload last (it may contain NUL bytes):
--   when_ms \0 attempts \0 worker \0 error \0 payload
-- `err` (the last failure) is cut to 2000 bytes and its NUL bytes become
-- spaces.
local function dead_record(now, attempts, worker, err, payload)
  err = string.gsub(string.sub(err or '', 1, 2000), '%z', ' ')
  return int(now) .. '\0' .. int(attempts) .. '\0' .. worker .. '\0' .. err .. '\0' .. payload
end
