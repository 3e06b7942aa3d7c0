-- include/hmget_all.lua: hmget_all; needs nothing.

-- HMGET of every field in `fields` (chunked like call_chunked): the values,
-- false for a missing one, in the order of `fields`.
local function hmget_all(key, fields)
  local out = {}
  for i = 1, #fields, 1000 do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(i + 999, #fields)))
    for j = 1, #part do out[i + j - 1] = part[j] end
  end
  return out
end
