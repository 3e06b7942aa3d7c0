-- configure_group.lua: set the settings of a group of a queue, or the
-- queue's default for every group (see "Groups" in README.md and
-- include/group.lua): concurrency (the most of its jobs running at once
-- across the mesh; 0: no cap), rate limit (jobs started per period across
-- the mesh; 0: none), its period (ms) and weight (its share of the claims
-- while other groups have jobs ready, 1..1000). A group's own setting, when
-- it has one, wins over the default.
--
-- KEYS[1] {ns}:idle:<Q>          SET of idle servers of Q (see include/wake_idle.lua);
--                                the group keys are made from its prefix
-- KEYS[2] {ns}:queues            SET of known queue names
-- ARGV[1] queue name Q
-- ARGV[2] prefix of wake channels ({ns}:wake:), the worker id is appended
-- ARGV[3] group name G, or "" for the queue's default
-- ARGV[4] mode: "set" (the fields given replace those stored; an empty
--         field leaves it as it is) or "clear" (the settings are removed:
--         the group follows the default again; no fields)
-- ARGV[5] concurrency, ARGV[6] rate limit, ARGV[7] period in ms (>= 1),
-- ARGV[8] weight (1..1000): whole numbers, or "" (mode "set")
-- Returns: the settings stored afterwards, "concurrency,rate,period,weight"
--          (a field empty: the default's), or false after "clear". Running
--          it twice stores the same settings.
-- Errors: BAD_ARG (group name, mode, a value).
-- Publishes: Q on the wake channels of idle servers of Q when a group may
--            start more jobs than before.
-- Cost: O(1), but where a concurrency cap comes or goes (a group's, or the
--       default's for the groups without one of their own): then O(Q's
--       running processes), whose records tell each group's jobs running
--       (only a group with a cap counts them: include/group.lua).
--!include include/count_arg.lua
--!include include/group.lua
local groups = group_lib()

local q, g, mode = ARGV[1], ARGV[3], ARGV[4]
if g ~= '' and (not string.match(g, '^[A-Za-z0-9_.:/@+=-]+$') or #g > 200) then
  return redis.error_reply('BAD_ARG group name must be 1 to 200 of A-Z a-z 0-9 _ . : / @ + = -')
end
if mode ~= 'set' and mode ~= 'clear' then
  return redis.error_reply('BAD_ARG mode must be "set" or "clear"')
end
local prefix = string.match(KEYS[1], '^(%b{}:)')
local G = groups.keys(prefix, q)
local field = g == '' and ':default' or 'c:' .. g
local stored = nil
local before = redis.call('HMGET', G.hash, ':default', field)
-- with the default: the groups whose counts may change, as they are before
local all = g == '' and redis.call('HGETALL', G.hash) or nil
if mode == 'set' then
  local was = before[2]
  local old = {'', '', '', ''}
  if was then old = {string.match(was, '^(%d*),(%d*),(%d*),([%d.]*)$')} end
  local names = {'concurrency', 'rate limit', 'rate period', 'weight'}
  local new = {}
  for i = 1, 4 do
    local v = ARGV[4 + i] or ''
    if v == '' then
      new[i] = old[i] or ''
    else
      local x, err = count_arg(v, names[i], i == 4 and 1000 or nil)
      if err then return err end
      if (i == 3 or i == 4) and x < 1 then
        return redis.error_reply('BAD_ARG ' .. names[i] .. ' must be >= 1')
      end
      new[i] = string.format('%.0f', x)
    end
  end
  stored = table.concat(new, ',')
  redis.call('SADD', KEYS[2], q)
  -- ':c' counts the groups with settings of their own (the claim reads
  -- none while there is none: include/group.lua)
  if redis.call('HSET', G.hash, field, stored) == 1 and g ~= '' then
    redis.call('HINCRBY', G.hash, ':c', 1)
  end
elseif redis.call('HDEL', G.hash, field) == 1 and g ~= '' then
  if redis.call('HINCRBY', G.hash, ':c', -1) <= 0 then redis.call('HDEL', G.hash, ':c') end
end
-- A cap that comes or goes: the group's jobs running start or stop counting
-- in its 'r:' field (include/group.lua, group_recount)
local function capped(own, dflt)
  return groups.settings(own or nil, dflt and groups.parse(dflt) or {}) > 0
end
local running = nil
if g ~= '' then
  local was_c, now_c = capped(before[2], before[1]), capped(stored, before[1])
  if was_c ~= now_c then
    running = groups.running(prefix .. 'procs:' .. q)
    groups.recount(G, g, running[g], now_c)
  end
elseif capped(nil, before[1]) ~= capped(nil, stored) then
  running = groups.running(prefix .. 'procs:' .. q)
  local names = {}
  for name in pairs(running) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    -- (a group's own cap, if it has one, stays)
    local own = redis.call('HGET', G.hash, 'c:' .. name)
    local was_c, now_c = capped(own, before[1]), capped(own, stored)
    if was_c ~= now_c then groups.recount(G, name, running[name], now_c) end
  end
end
-- a group may start more now: ready again (with the default, each group
-- that had a count or runs jobs: the others are ready already, or have none
-- queued)
local woke = 0
if g ~= '' then
  if groups.ready(G, g) then woke = 1 end
else
  local seen = {}
  for i = 1, #all, 2 do
    local f = all[i]
    if string.sub(f, 1, 2) == 'r:' then
      local name = string.sub(f, 3)
      seen[name] = true
      if groups.ready(G, name) then woke = woke + 1 end
    end
  end
  for name in pairs(running or {}) do
    if not seen[name] and groups.ready(G, name) then woke = woke + 1 end
  end
end
if woke > 0 then wake_idle(KEYS[1], ARGV[2], q, woke) end
return stored or false
