-- include/id_strings.lua: id_strings, dec_succ, dec_max; needs nothing.

-- Process ids (fencing tokens) are decimal strings, worked on as strings so
-- that they stay exact past 2^53, where a Lua number (a double) can no
-- longer add 1 (a counter set that high would hand out one token twice).

-- The decimal string `s` (digits only, no sign) plus one.
local function dec_succ(s)
  local i = #s
  while i > 0 and string.byte(s, i) == 57 do i = i - 1 end  -- trailing '9's
  if i == 0 then return '1' .. string.rep('0', #s) end
  return string.sub(s, 1, i - 1) .. string.char(string.byte(s, i) + 1) .. string.rep('0', #s - i)
end

-- The larger of two decimal strings without leading zeros.
local function dec_max(a, b)
  if #a ~= #b then
    if #a > #b then return a end
    return b
  end
  if a > b then return a end
  return b
end

-- The `k` process ids first, first + 1, .. as decimal strings (`first` is
-- one), with no string.format in the usual case (the dearest thing Lua does
-- per claimed task): the last two digits are cut out of a constant, the rest
-- is carried as a string.
local function id_strings(first, k)
  local digits = '00010203040506070809101112131415161718192021222324252627282930313233343536373839404142434445464748495051525354555657585960616263646566676869707172737475767778798081828384858687888990919293949596979899'
  local out = {}
  local sub = string.sub  -- in a register: no lookup per id
  local head, low = sub(first, 1, -3), tonumber(sub(first, -2))
  for i = 1, k do
    if low == 100 then
      head, low = dec_succ(head), 0
    end
    if head == '' then
      out[i] = tostring(low)
    else
      out[i] = head .. sub(digits, 2 * low + 1, 2 * low + 2)
    end
    low = low + 1
  end
  return out
end
