-- include/group.lua: a queue's groups (see "Groups" in README.md):
-- group_lib, whose table holds keys, keys_of, ready, release_many, tally,
-- release, push, prio_gone, due and claim (the functions group_keys,
-- group_keys_of, group_ready, ... below, with group_parse, group_default and
-- group_settings, which they use); needs:
--!include include/rate.lua
--!include include/wake_idle.lua
--!include include/prio_add.lua

-- The keys of a queue's groups are made here, from the namespace's prefix
-- ({ns}:, taken from a key of the queue that the script was given: every
-- key of a namespace shares its hash slot) and the queue's name Q:
--   {ns}:gready:<Q>    ZSET group -> its place in line (a turn number):
--                      the groups that may start a job now (jobs queued,
--                      below their concurrency, not paused, not waiting for
--                      a token), the front first; the member "" stands for
--                      Q's ungrouped tasks, while Q has ready groups
--   {ns}:groups:<Q>    HASH 'r:'..G -> G's slots in use: of a group with a
--                      concurrency cap, its jobs running and its retries
--                      waiting for their backoff (a retry holds its slot);
--                      of a group without one, its retries only (nothing
--                      reads or writes a count per job of a group that has
--                      no cap: see group_recount); 'c:'..G -> G's
--                      own settings; 'p:'..G -> when G was paused (ms);
--                      ':default' -> the settings of every group; ':v' -> the
--                      back of the line (the last turn number a claim gave);
--                      ':u' -> how much of its turn the group at the front
--                      has taken, as the jobs .. ':' .. its name (e.g.
--                      "2:tenant-7"; "": a whole turn is its);
--                      ':n' -> the jobs queued in all of Q's groups;
--                      ':np' -> those of them with a priority (while there
--                      are none, a claim reads no group's priorities)
--   {ns}:gwait:<Q>     ZSET group -> when (ms) its rate limit gives it a token
--   {ns}:gdelayed:<Q>  ZSET G .. '\0' .. flag .. level .. payload -> due time
--                      (ms): flag 'r' is a retry (it holds G's slot until
--                      due), 'd' a job enqueued with a delay; level the
--                      job's priority, one digit (0: none)
--   {ns}:gq:<Q>|<G>    LIST G's queued jobs without a priority, head = next
--   {ns}:gp:<Q>|<G>    ZSET G's queued jobs with a priority (1..9), as
--                      {ns}:prio:<Q> (include/prio_add.lua): they start
--                      before the list, the highest priority first
--   {ns}:grate:<Q>|<G> HASH G's token bucket (include/rate.lua)
-- Settings are "concurrency,rate,period_ms,weight", each field empty for
-- "as the queue's default" (and then: no cap, no rate limit, 1000, 1).

-- The functions are made on first use: a script calls group_lib() for
-- their table (made once per call). A call that meets no group (a plain
-- claim, a finish of ungrouped tasks) makes none of their closures: every
-- function of a script's includes is made anew at every call, and the
-- closures, the upvalues they capture and the garbage they leave cost
-- Redis instructions on every claim (counted with callgrind: see "Loading
-- the scripts" in README.md).
local group_fns

local function group_lib()
  if group_fns then return group_fns end
  local GROUPS = {}  -- per queue of this script call: its keys and settings

  -- A number as the argument of a command: a whole one in decimal (Redis
  -- turns a Lua number into text with "%.17g", a float's printf, which cost
  -- a claim of 30 jobs of 100,000 groups a fifth of its instructions,
  -- counted with callgrind), another as Redis would have written it; each
  -- text made once per call (the counts of a claim repeat: Lua's
  -- string.format is a printf too).
  local min, max, floor = math.min, math.max, math.floor  -- (in registers)
  local NUMS, PARSED = {}, {}
  local function num(x)
    local t = NUMS[x]
    if t then return t end
    if x % 1 == 0 then t = string.format('%d', x) else t = string.format('%.17g', x) end
    NUMS[x] = t
    return t
  end
  -- The number of a decimal text (a running count), each text converted
  -- once per call: the counts of a claim's groups repeat, and tonumber runs
  -- strtod twice.
  local function parse(t)
    local x = PARSED[t]
    if not x then
      x = t + 0
      PARSED[t] = x
    end
    return x
  end

  -- The group keys of queue `q`, whose keys start with `prefix` ({ns}:).
  local function group_keys(prefix, q)
    local G = GROUPS[q]
    if not G then
      G = {q = q, ready = prefix .. 'gready:' .. q, hash = prefix .. 'groups:' .. q,
           wait = prefix .. 'gwait:' .. q, delayed = prefix .. 'gdelayed:' .. q,
           list = prefix .. 'gq:' .. q .. '|', prio = prefix .. 'gp:' .. q .. '|',
           rate = prefix .. 'grate:' .. q .. '|',
           idle = prefix .. 'idle:' .. q, wake = prefix .. 'wake:'}
      GROUPS[q] = G
    end
    return G
  end

  -- The group keys of the queue whose key `key` is {ns}:<kind>:<Q> (kind:
  -- the word before Q, e.g. 'procs').
  local function group_keys_of(key, kind)
    local prefix = string.match(key, '^(%b{}:)')
    return group_keys(prefix, string.sub(key, #prefix + #kind + 2))
  end

  -- Settings "c,r,p,w" as a table of four numbers (false: not set).
  local function group_parse(raw)
    local c, r, p, w = string.match(raw, '^(%d*),(%d*),(%d*),([%d.]*)$')
    return {tonumber(c) or false, tonumber(r) or false, tonumber(p) or false, tonumber(w) or false}
  end

  -- The queue's default settings (group_parse's table; {} when it has none)
  -- and whether any group has settings of its own (the hash's ':c', their
  -- count), read once per script call.
  local function group_default(G)
    if not G.dflt then
      local h = redis.call('HMGET', G.hash, ':default', ':c')
      G.dflt = h[1] and group_parse(h[1]) or {}
      G.own = h[2] ~= false and h[2] ~= nil
    end
    return G.dflt
  end

  -- A group starts at most this many jobs (times its weight) per turn
  -- before the next group's turn: round-robin by turns (deficit
  -- round-robin), whose quantum makes a claim among many backlogged groups
  -- pop three jobs per group visited rather than one. Each group visited
  -- costs a claim about the same whatever it pops (an LPOP, its place in
  -- line, its count), so a claim among groups of 10 jobs costs by its
  -- visits: 6 at a quantum of 2 (five that pop two, one that finds the
  -- group empty), 4 at 3, 3 at 4. Measured (bench groups' cost: 100,000
  -- groups x 10 against one group of 1,000,000, one worker at concurrency
  -- 10, a 2-core Xeon, while the order was by virtual time): a quantum of 2
  -- ran at 0.72x of one group, 3 at 0.78x; in Redis instructions
  -- (callgrind, 2,000 groups x 10 against one group) 2 cost 1.40x one
  -- group's per job, 3 1.29x, 4 1.22x. Fairness (bench groups, 3 runs
  -- each): Jain's index over the backlogged groups 0.98-1.00 at 2,
  -- 0.98-0.99 at 3, 0.94-0.99 at 4 (under the issue's 0.95 once). An older
  -- measure (20,000 groups x 10): 1 ran at 0.44x.
  local QUANTUM = 3

  -- Concurrency (0: no cap), rate (0: none), period (ms) and weight of a
  -- group whose own settings are `own` (a raw "c,r,p,w", nil: none), given
  -- the queue's default `d` (group_default's table). A group with no own
  -- settings costs no parsing.
  local function group_settings(own, d)
    if not own then return d[1] or 0, d[2] or 0, d[3] or 1000, d[4] or 1 end
    local o = group_parse(own)
    return o[1] or d[1] or 0, o[2] or d[2] or 0, o[3] or d[3] or 1000, o[4] or d[4] or 1
  end

  -- Put group `g` among the ready groups if it may start a job now: jobs
  -- queued, below its concurrency, not paused, not waiting for a token. It
  -- comes in at the back of the line, one turn number after the last that a
  -- claim gave (':v'; the next claim sends its groups one further back): a
  -- group gets no credit for the time it could not run. Returns whether it
  -- came in.
  local function group_ready(G, g)
    local h = redis.call('HMGET', G.hash, 'r:' .. g, 'c:' .. g, 'p:' .. g, ':v')
    if h[3] then return false end
    local cap = group_settings(h[2], group_default(G))
    if cap > 0 and tonumber(h[1] or '0') >= cap then return false end
    if redis.call('EXISTS', G.list .. g, G.prio .. g) == 0 then return false end
    if redis.call('ZSCORE', G.wait, g) then return false end
    return redis.call('ZADD', G.ready, 'NX', num(tonumber(h[4] or '0') + 1), g) == 1
  end

  -- `counts[g]` jobs of each group g of `order` no longer run (finished,
  -- failed, handed back, recycled, cancelled), or with `held`, that many of
  -- its retries no longer wait for their backoff (due, cancelled): their
  -- slots are free. The counts go down (a field leaves at 0), in one HMGET
  -- and one HDEL and HSET for all of them (per 1000 groups): of a job, only
  -- a group with a cap has one (none was counted at its claim); of a retry,
  -- every group. A group that was at its cap is ready again if it may be,
  -- and idle servers of Q are woken for those. Only a group at its cap can
  -- have left the ready groups for it (emptied, paused or waiting for a
  -- token, it stays out). While no group has a cap, a job's end reads and
  -- writes nothing here.
  local function group_release_many(G, order, counts, held)
    local d = group_default(G)
    -- a cap at all: the default's, or a group's own (then read them)
    local own, capped = G.own, (d[1] or 0) > 0
    if not (held or own or capped) then return end
    local step = own and 2 or 1
    local woke = 0
    for c = 1, #order, 1000 do
      local fields = {}
      local last = math.min(c + 999, #order)
      for i = c, last do
        fields[#fields + 1] = 'r:' .. order[i]
        if own then fields[#fields + 1] = 'c:' .. order[i] end
      end
      local vals = redis.call('HMGET', G.hash, unpack(fields))
      local set, del, again = {}, {}, {}
      for i = c, last do
        local j = step * (i - c) + 1
        local cap = 0
        if capped or own then cap = group_settings(own and vals[j + 1] or nil, d) end
        if held or cap > 0 then
          local was = vals[j] and parse(vals[j]) or 0
          local r = was - counts[order[i]]
          if r > 0 then
            set[#set + 1] = fields[j]
            set[#set + 1] = num(r)
          else
            del[#del + 1] = fields[j]
          end
          if cap > 0 and was >= cap then again[#again + 1] = order[i] end
        end
      end
      -- HDEL first: the first write must be one Redis does not refuse at the
      -- memory limit (see "At the memory limit" in README.md)
      if #del > 0 then redis.call('HDEL', G.hash, unpack(del)) end
      if #set > 0 then redis.call('HSET', G.hash, unpack(set)) end  -- (counts as text: num)
      for _, g in ipairs(again) do
        if group_ready(G, g) then woke = woke + 1 end
      end
    end
    if woke > 0 then wake_idle(G.idle, G.wake, G.q, woke) end
  end

  -- Count one more of group `g` in `counts` (group -> count), `order`
  -- keeping the groups in the order first counted (what group_release_many
  -- takes).
  local function group_tally(order, counts, g)
    local n = counts[g]
    if not n then
      order[#order + 1] = g
      n = 0
    end
    counts[g] = n + 1
  end

  -- `n` of group `g`'s jobs no longer run, or with `held` its retries no
  -- longer wait (see group_release_many).
  local function group_release(G, g, n, held)
    group_release_many(G, {g}, {[g] = n}, held)
  end

  -- `counts[g]` jobs of each group g of `order` failed and wait for their
  -- backoff to run again: each holds its group's slot until due. A group
  -- with a cap counted the job at its claim already; a group without one
  -- counts the retry now (group_release_many with `held` takes it off).
  local function group_hold_many(G, order, counts)
    local d = group_default(G)
    if (d[1] or 0) > 0 and not G.own then return end  -- every group has a cap
    for _, g in ipairs(order) do
      local own = G.own and redis.call('HGET', G.hash, 'c:' .. g) or nil
      if group_settings(own, d) == 0 then redis.call('HINCRBY', G.hash, 'r:' .. g, counts[g]) end
    end
  end

  -- Each group's jobs running in Q, from the records of {ns}:procs:<Q>
  -- (`procs`; a group's job's kind is 'g' level group: include/record.lua):
  -- a table group -> count. O(Q's processes); configure_group's alone.
  -- (HGETALL, not HVALS: the commands of docs/operating.md's ACL user)
  local function group_running(procs)
    local out = {}
    local all = redis.call('HGETALL', procs)
    for i = 2, #all, 2 do
      local g = string.match(all[i], '^[^%z]*%zg.([^%z]*)%z')
      if g then out[g] = (out[g] or 0) + 1 end
    end
    return out
  end

  -- Group `g`'s cap comes or goes (its concurrency turns from 0 to more,
  -- `on`, or back to 0): its `running` jobs (group_running's count) start
  -- or stop counting in 'r:'..g, which then again holds what it must (a
  -- group with a cap: its jobs and its retries; without: its retries).
  local function group_recount(G, g, running, on)
    if not running or running == 0 then return end
    if on then
      redis.call('HINCRBY', G.hash, 'r:' .. g, running)
    elseif redis.call('HINCRBY', G.hash, 'r:' .. g, -running) <= 0 then
      redis.call('HDEL', G.hash, 'r:' .. g)
    end
  end

  -- Put `payloads` (in order) into group `g`: at its front (`front`) or its
  -- back, each at its priority: `levels` is nil (none has one), a level for
  -- all, or a table of levels, one per payload (0: none; a job with a
  -- priority goes to the front or back of its level in {ns}:gp:<Q>|<G>); the
  -- group is ready if it may be. Returns the group's queued jobs.
  local function group_push(G, g, payloads, front, levels)
    if #payloads == 0 then return 0 end
    local plain = payloads
    if levels and levels ~= 0 then
      -- the prioritized ones, per level in order, and the rest
      local order, at
      plain, order, at = prio_split(payloads, levels)
      for _, l in ipairs(order) do prio_add(G.prio .. g, l, at[l], front) end
      if #plain < #payloads then redis.call('HINCRBY', G.hash, ':np', #payloads - #plain) end
    end
    local len = 0
    local key = G.list .. g
    redis.call('HINCRBY', G.hash, ':n', #payloads)
    if front then
      for i = #plain, 1, -1 do len = redis.call('LPUSH', key, plain[i]) end
    else
      for i = 1, #plain, 4000 do
        len = redis.call('RPUSH', key, unpack(plain, i, math.min(i + 3999, #plain)))
      end
    end
    if plain ~= payloads then len = redis.call('LLEN', key) + redis.call('ZCARD', G.prio .. g) end
    group_ready(G, g)
    return len
  end

  -- `n` queued jobs with a priority left Q's groups (claimed, cancelled).
  local function group_prio_gone(G, n)
    if n > 0 and redis.call('HINCRBY', G.hash, ':np', -n) <= 0 then redis.call('HDEL', G.hash, ':np') end
  end

  -- Move up to `n` delayed jobs of Q's groups that are due at `now` to the
  -- front of their groups (a retry gives its slot back then). Returns the ms
  -- until the next one is due (-1: none left).
  local function group_due(G, now, n)
    local due = redis.call('ZRANGEBYSCORE', G.delayed, '-inf', now, 'LIMIT', 0, n)
    if #due > 0 then
      redis.call('ZREM', G.delayed, unpack(due))
      local order, jobs, levels, freed = {}, {}, {}, {}
      for _, m in ipairs(due) do
        local g, flag, level, payload = string.match(m, '^([^%z]*)%z(.)(.)(.*)$')
        if not jobs[g] then
          jobs[g], levels[g], freed[g] = {}, {}, 0
          order[#order + 1] = g
        end
        local js = jobs[g]
        js[#js + 1] = payload
        levels[g][#js] = string.byte(level) - 48
        if flag == 'r' then freed[g] = freed[g] + 1 end
      end
      for _, g in ipairs(order) do
        group_push(G, g, jobs[g], true, levels[g])
        if freed[g] > 0 then group_release(G, g, freed[g], true) end
      end
    end
    local first = redis.call('ZRANGE', G.delayed, 0, 0, 'WITHSCORES')
    if #first == 0 then return -1 end
    return math.max(0, tonumber(first[2]) - now)
  end

  -- Take up to `n` jobs from Q's ready groups, in weighted round-robin by
  -- turns: the group at the front of the line (the lowest turn number)
  -- starts up to QUANTUM x its weight jobs, then goes to the back (a turn
  -- number above every other); `ungrouped` tasks of Q (its list and its
  -- priorities) take turns as one more group ("", weight 1). A turn that a
  -- claim cuts short (it was full) goes on at the next claim: the group
  -- stays at the front, and ':u' says how much of its turn it took. While
  -- every ready group is in hand, each takes as many whole turns as the
  -- claim has room for in one go (one group alone: all it wants). A group
  -- stops being ready when it empties, reaches its concurrency or runs out
  -- of tokens (it then waits in {ns}:gwait:<Q>). Each group's running count
  -- goes up by what it started. Cost: O(log groups) per group served, the
  -- same whatever the number of groups and jobs (a group goes to the back
  -- of the line: its skip list insert walks the nodes last touched). A
  -- group's jobs with a priority start before its others (include/
  -- prio_add.lua's order). Returns the jobs taken (their payloads, their
  -- groups and their priorities: three lists in order, the last one holding
  -- only those above 0), the turns of the ungrouped tasks, and the ms until
  -- a group waiting for a token gets one (-1: none).
  local function group_claim(G, n, now, ungrouped)
    local taken, tgroups, tlevels, turns = {}, {}, {}, 0
    -- (G.has_wait: a caller that knows {ns}:gwait:<Q> is missing says so)
    if G.has_wait ~= false then
      local back = redis.call('ZRANGEBYSCORE', G.wait, '-inf', now, 'LIMIT', 0, 1000)
      if #back > 0 then
        redis.call('ZREM', G.wait, unpack(back))
        for _, g in ipairs(back) do group_ready(G, g) end
      end
    end
    local popped, ppopped = 0, 0
    -- the line's back and its front's turn so far, the default settings,
    -- whether any group has its own, and whether any group has jobs with a
    -- priority, in one read
    local h = redis.call('HMGET', G.hash, ':v', ':default', ':c', ':np', ':u')
    local v = tonumber(h[1] or '0')
    local v0 = v
    local f_used, f_g = string.match(h[5] or '', '^(%d+):(.*)$')
    f_used = tonumber(f_used)
    local np = h[4] and tonumber(h[4]) > 0
    if not G.dflt then
      G.dflt = h[2] and group_parse(h[2]) or {}
      G.own = h[3] ~= false and h[3] ~= nil
    end
    local d = G.dflt
    local own = G.own
    -- while no group has a cap, no count is read or written (a job's count
    -- matters only to its group's cap)
    local counted = own or (d[1] or 0) > 0
    if ungrouped > 0 then redis.call('ZADD', G.ready, 'NX', num(v + 1), '') end
    -- the group a full claim leaves at the front, and how much of its turn
    -- it has taken
    local p_used, p_g = 0, nil
    -- Round after round until the claim is full or no group is ready: each
    -- round takes a job or takes a group out of the ready set (one that
    -- emptied since its last turn, reached its cap or ran out of tokens), so
    -- the rounds end, and a claim never comes back short while a group has a
    -- job it may start (the worker would wait, idle, for a wake that no one
    -- sends).
    local rounds, removed, waited = 0, false, false
    while n > 0 do
      rounds = rounds + 1
      -- enough groups for the claim at QUANTUM jobs each, and one more (to
      -- know whether every ready group is in hand); more in a later round
      -- if those had fewer
      local want = rounds == 1 and math.ceil(n / QUANTUM) or n
      local top = redis.call('ZRANGE', G.ready, 0, want)
      local m = #top
      if m == 0 then break end
      local all = m <= want
      if not all then m = want end
      local n_before = n
      local fields, at = {}, {}
      for i = 1, m do
        local g = top[i]
        if g ~= '' and counted then
          at[i] = #fields + 1
          fields[#fields + 1] = 'r:' .. g
          if own then fields[#fields + 1] = 'c:' .. g end
        end
      end
      local vals = #fields > 0 and redis.call('HMGET', G.hash, unpack(fields)) or {}
      -- every ready group in hand: each takes as many whole turns as the
      -- claim has room for (one group alone: the whole claim, and it keeps
      -- its place)
      local turns_each, alone = 1, all and m == 1
      if all and not alone then
        local sum = 0
        for i = 1, m do
          local g = top[i]
          local w = 1
          if g ~= '' and own then w = select(4, group_settings(vals[at[i] + 1], d)) end
          if g ~= '' and not own then w = d[4] or 1 end
          sum = sum + QUANTUM * w
        end
        turns_each = max(1, floor(n / sum))
      end
      -- the groups that go to the back of the line: after every other, and
      -- after those that came in since the last claim (at ':v' + 1)
      local back = num(v + 2)
      local adds, rems, counts = {}, {}, {}
      for i = 1, m do
        if n <= 0 then break end
        local g = top[i]
        -- the part of its turn it took at earlier claims (it was at the front)
        local used = 0
        if rounds == 1 and i == 1 and g == f_g then used = f_used end
        p_g = nil
        if g == '' then
          local turn = max(1, QUANTUM * turns_each - used)
          local k = ungrouped - turns
          if not alone then k = min(k, turn) end
          k = min(k, n)
          turns, n = turns + k, n - k
          if turns >= ungrouped then
            rems[#rems + 1] = ''
          elseif alone then  -- (keeps its place)
          elseif k >= turn then
            adds[#adds + 1] = back
            adds[#adds + 1] = ''
          else
            p_used, p_g = used + k, ''
          end
        else
          local j = at[i]
          local running, cap, rate, per, w = 0, nil, nil, nil, nil
          if counted then
            running = vals[j] and parse(vals[j]) or 0
            cap, rate, per, w = group_settings(own and vals[j + 1] or nil, d)
          else
            cap, rate, per, w = group_settings(nil, d)
          end
          local turn = max(1, QUANTUM * w * turns_each - used)
          local k = n
          if cap > 0 then k = min(k, cap - running) end
          if not alone then k = min(k, turn) end
          local tokens, waiting = nil, false
          -- (a paused group is never here: pause_group takes it out, and
          -- group_ready does not put it back)
          if rate > 0 and k > 0 then
            tokens = rate_tokens(G.rate .. g, rate, per, now)
            if tokens < 1 then
              redis.call('ZADD', G.wait, now + rate_wait(tokens, rate, per), g)
              waiting, waited, k = true, true, 0
            else
              k = min(k, floor(tokens))
            end
          end
          local got = 0
          if k > 0 then
            if np then
              -- its jobs with a priority first: member = level, order, payload
              local pz = redis.call('ZPOPMIN', G.prio .. g, k)
              for x = 1, #pz, 2 do
                taken[#taken + 1] = string.sub(pz[x], 17)
                tgroups[#taken] = g
                tlevels[#taken] = string.byte(pz[x], 1) - 48
              end
              got = #pz / 2
              ppopped = ppopped + got
            end
            if got < k then
              local items = redis.call('LPOP', G.list .. g, num(k - got)) or {}
              got = got + #items
              local nt = #taken
              for x = 1, #items do
                taken[nt + x] = items[x]
                tgroups[nt + x] = g
              end
            end
            popped = popped + got
            n = n - got
          end
          if got > 0 then
            if cap > 0 then
              running = running + got
              counts[#counts + 1] = fields[j]
              counts[#counts + 1] = num(running)
            end
            if tokens then
              redis.call('HSET', G.rate .. g, 'tokens', tostring(tokens - got), 'at', now)
              redis.call('PEXPIRE', G.rate .. g, per + 1000)
            end
          end
          if got < k or k <= 0 or (cap > 0 and running >= cap) or waiting then
            rems[#rems + 1] = g
          elseif alone then  -- (keeps its place)
          elseif got >= turn then
            adds[#adds + 1] = back
            adds[#adds + 1] = g
          else
            -- the claim is full (or the tokens ran short): the rest of its
            -- turn at the next claim
            p_used, p_g = used + got, g
          end
        end
      end
      if #counts > 0 then redis.call('HSET', G.hash, unpack(counts)) end
      if #rems > 0 then
        redis.call('ZREM', G.ready, unpack(rems))
        removed = true
      end
      if #adds > 0 then
        redis.call('ZADD', G.ready, 'XX', unpack(adds))
        v = v + 2
      end
      if n == n_before and #rems == 0 then break end  -- (cannot happen: a safeguard)
    end
    if popped > 0 and redis.call('HINCRBY', G.hash, ':n', -popped) <= 0 then
      redis.call('HDEL', G.hash, ':n')
    end
    group_prio_gone(G, ppopped)
    -- no group left ready: Q's ungrouped tasks take the plain path again, and
    -- the line starts again from 0 (nothing is left in it); only a claim
    -- that took groups out of the ready set can have emptied it
    local left = removed and redis.call('ZCARD', G.ready) or 2
    if left == 1 and redis.call('ZREM', G.ready, '') == 1 then left = 0 end
    if left == 0 then
      if h[1] or h[5] then redis.call('HDEL', G.hash, ':v', ':u') end
    else
      -- the line's back and its front's turn so far, what changed of them
      -- in one write (':u' "" rather than a second call to delete it)
      local u = p_g and num(p_used) .. ':' .. p_g or ''
      local set = {}
      if v ~= v0 then set[1], set[2] = ':v', num(v) end
      if u ~= (h[5] or '') then
        local i = #set
        set[i + 1], set[i + 2] = ':u', u
      end
      if #set > 0 then redis.call('HSET', G.hash, unpack(set)) end
    end
    local wait = -1
    if G.has_wait ~= false or waited then
      local first = redis.call('ZRANGE', G.wait, 0, 0, 'WITHSCORES')
      if #first > 0 then wait = max(0, tonumber(first[2]) - now) end
    end
    return taken, tgroups, turns, wait, tlevels
  end

  group_fns = {keys = group_keys, keys_of = group_keys_of, ready = group_ready,
    release_many = group_release_many, tally = group_tally, release = group_release,
    hold_many = group_hold_many, running = group_running, recount = group_recount,
    parse = group_parse, settings = group_settings,
    push = group_push, prio_gone = group_prio_gone, due = group_due, claim = group_claim}
  return group_fns
end
