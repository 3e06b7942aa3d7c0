-- include/id_strings.lua: id_strings; needs nothing.

-- The `k` process ids first, first + 1, .. as decimal strings, as int()
-- writes them, with one string.format in the usual case instead of one per id
-- (string.format is the dearest thing Lua does per claimed task): the last
-- two digits are cut out of a constant. Ids are whole numbers below 2^53.
local function id_strings(first, k)
  local digits = '00010203040506070809101112131415161718192021222324252627282930313233343536373839404142434445464748495051525354555657585960616263646566676869707172737475767778798081828384858687888990919293949596979899'
  local out = {}
  -- string.format as int() does, not int(): a script calling this one
  -- then need not make int()'s closure at every call
  local head, low = string.format('%.0f', math.floor(first / 100)), first % 100
  for i = 1, k do
    if low == 100 then
      head, low = string.format('%.0f', math.floor((first + i - 1) / 100)), 0
    end
    if head == '0' then
      out[i] = string.format('%.0f', low)
    else
      out[i] = head .. string.sub(digits, 2 * low + 1, 2 * low + 2)
    end
    low = low + 1
  end
  return out
end
