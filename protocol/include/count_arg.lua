-- include/count_arg.lua: count_arg; needs nothing.

local function count_arg(v, name, max)
  local n = tonumber(v)
  if not n or n < 0 or n ~= math.floor(n) or (max and n > max) then
    return nil, redis.error_reply('BAD_ARG ' .. name .. ' must be a whole number'
      .. (max and (' from 0 to ' .. max) or ' >= 0'))
  end
  return n, nil
end
