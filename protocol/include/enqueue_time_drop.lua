-- include/enqueue_time_drop.lua: enqt_drop (enqueue times that leave: see
-- include/enqueue_time.lua); needs:
--!include include/call_chunked.lua

-- The payloads `list` of the queue whose key `{ns}:<word>:<Q>` is `key`
-- left for good: their times go (a ZREM per 1,000; on a queue that keeps
-- none, a ZREM of a missing key, which writes nothing).
local function enqt_drop(key, word, list)
  local prefix = string.match(key, '^(%b{}:)')
  call_chunked('ZREM', prefix .. 'enqt:' .. string.sub(key, #prefix + #word + 2), list)
end
