-- include/sorted_ids.lua: sorted_ids; needs nothing.

-- Process ids in claim order (ids are tokens, increasing with claim time).
-- Decimal strings without leading zeros of one length sort as numbers do,
-- and a plain sort of strings is much cheaper in Lua than a comparator.
local function sorted_ids(ids)
  local len = ids[1] and #ids[1]
  for i = 2, #ids do
    if #ids[i] ~= len then
      table.sort(ids, function(a, b) return tonumber(a) < tonumber(b) end)
      return ids
    end
  end
  table.sort(ids)
  return ids
end
