-- include/prio_add.lua: prio_add, prio_split; needs:
--!include include/call_chunked.lua

-- Priorities. A one-shot task with a priority of 1..9 waits in
-- {ns}:prio:<Q>, a ZSET scored -priority whose members are the priority (one
-- digit), a 15-digit order number and the payload: ZPOPMIN takes the highest
-- priority first and, within one, the lowest order number (members of one
-- score sort as strings, and the numbers have one width): FIFO within a
-- level. The digit keeps copies of a payload at two levels apart. Priority 0
-- is the queue's list. Adds `payloads` at the back of `level`, in order, or
-- with `front` at its front (payloads[1] first). O(log n) per task.
local function prio_add(prio, level, payloads, front)
  if #payloads == 0 then return end
  local s = -level
  local edge
  if front then
    edge = redis.call('ZRANGEBYSCORE', prio, s, s, 'LIMIT', 0, 1)
  else
    edge = redis.call('ZREVRANGEBYSCORE', prio, s, s, 'LIMIT', 0, 1)
  end
  local seq = 5e14
  if #edge > 0 then
    seq = tonumber(string.sub(edge[1], 2, 16))
    if front then seq = seq - #payloads else seq = seq + 1 end
  end
  local args = {}
  for i, p in ipairs(payloads) do
    args[#args + 1] = s
    args[#args + 1] = level .. string.format('%015.0f', seq + i - 1) .. p
  end
  call_chunked('ZADD', prio, args, 2)
end

-- `payloads` (in order) split by priority, `levels` a level for all or a
-- table of one per payload: those of level 0 (a list, in order), the levels
-- of the others in the order first met, and per level its payloads in order
-- (what prio_add takes).
local function prio_split(payloads, levels)
  local plain, order, at = {}, {}, {}
  for i, p in ipairs(payloads) do
    local l = type(levels) == 'table' and levels[i] or levels
    if l > 0 then
      if not at[l] then
        at[l] = {}
        order[#order + 1] = l
      end
      table.insert(at[l], p)
    else
      plain[#plain + 1] = p
    end
  end
  return plain, order, at
end
