-- include/claim_run.lua: claim_run(keys, argv, before, compact), the claim
-- of claim.lua (see its header for the keys, arguments and reply), shared
-- with finish_claim.lua, and claim_reply, which shapes its reply (compact,
-- and with a caller's items appended). claim_run is given its keys and
-- arguments: `keys` and `argv` are lists laid out as claim.lua's KEYS[1..19]
-- and ARGV[1..13] (a script passes its own KEYS and ARGV); it reads nothing
-- else of the script's; needs:
--!include include/now_ms_us.lua
--!include include/id_strings.lua
--!include include/lease_error.lua
--!include include/count_arg.lua
--!include include/call_chunked.lua
--!include include/hmget_all.lua
--!include include/prio_add.lua
--!include include/rate.lua
--!include include/wake_idle.lua
--!include include/task_weight.lua
--!include include/add_share.lua
--!include include/fair_share.lua
--!include include/expire_reserved.lua
--!include include/group.lua

-- The reply `out`, with `tail`'s items appended (nil: none). With
-- `compact`, a reply without processes gets the compact form's header:
-- {now, left, next_due, "", 0, 0} (see claim_run).
local function claim_reply(out, tail, compact)
  if compact and #out == 3 then
    out[4], out[5], out[6] = '', 0, 0
  end
  if tail then
    local o = #out
    for i = 1, #tail do out[o + i] = tail[i] end
  end
  return out
end

-- The claim of `keys` and `argv` (as claim.lua's KEYS and ARGV): the
-- checks (the arguments, W's lease, that W serves Q: an error reply, and
-- nothing is written), then `before()` if given (its list is appended to
-- the reply), then the claim itself. Returns the reply
-- or an error reply. With `compact`, the reply is {now, left, next_due,
-- the first process id ("": none), c processes, mixed (0/1/2), then the c
-- payloads, then, if mixed is 1, per process its persistent flag (1/0, or a
-- group's job's group name) and failed attempts so far; if mixed is 2, per
-- run of processes of one group (in order) the group ("": none) and the
-- run's length}: the ids of one claim are consecutive numbers; mixed is 0
-- when every process is an ungrouped one-shot task on its first attempt, 2
-- when every process is a one-shot task on its first attempt and some are
-- of groups (as claim.lua's reply, in fewer items).
local function claim_run(keys, argv, before, compact)
  -- claim.lua's keys and arguments by name (KEYS[2] is passed, not read;
  -- KEYS[18], the rate bucket, is read below only with a rate limit)
  local lease_key, queue_key, pers_key, procs_key, held_key = keys[1], keys[3], keys[4], keys[5], keys[6]
  local attempts_key, delayed_key, token_key, servers_key = keys[7], keys[8], keys[9], keys[10]
  local standby_key, idle_key, reserved_key, unowned_key = keys[11], keys[12], keys[13], keys[14]
  local share_key, prio_key, dprio_key, paused_key = keys[15], keys[16], keys[17], keys[19]
  local worker, incarnation, q, max_att, fair = argv[1], argv[2], argv[3], argv[5], argv[6]
  local backoff, backoff_cap, ttl, wake_flag = argv[7], argv[8], argv[9], argv[10]
  local wake_prefix, rate_limit, rate_period = argv[11], argv[12], argv[13]
  -- The counts: one match for all five in the usual case (plain decimal
  -- strings, kept as they are in the records); count_arg says which is wrong.
  local n, err, counts
  if ttl then  -- and so argv[4..8]
    counts = string.match(argv[4] .. ',' .. max_att .. ',' .. backoff .. ',' .. backoff_cap .. ','
      .. ttl, '^(%d%d?%d?%d?),%d+,%d+,%d+,%d+$')
  end
  if counts then
    n = tonumber(counts)
    if n > 1000 then counts = nil end
  end
  if not counts then
    n, err = count_arg(argv[4], 'claim count', 1000)
    if err then return err end
    local whole = {}
    local named = {{max_att, 'max attempts'}, {backoff, 'backoff'}, {backoff_cap, 'backoff cap'}, {ttl, 'ttl'}}
    for i, a in ipairs(named) do
      local v
      v, err = count_arg(a[1], a[2])
      if err then return err end
      whole[i] = string.format('%.0f', v)  -- as int() would
    end
    max_att, backoff, backoff_cap, ttl = whole[1], whole[2], whole[3], whole[4]
  end
  if n < 1 then return redis.error_reply('BAD_ARG claim count must be >= 1') end
  local patience = 0
  if fair ~= '0' and fair ~= '1' then
    patience = tonumber(fair)
    if not patience or patience < 2 or patience % 1 ~= 0 then
      return redis.error_reply('BAD_ARG fair share flag must be 0, 1 or a patience in ms >= 2')
    end
  end
  if wake_flag ~= '0' and wake_flag ~= '1' then
    return redis.error_reply('BAD_ARG wake flag must be 0 or 1')
  end
  local wake = wake_flag == '1'
  local bucket, rate, per = keys[18], nil, nil
  if (rate_limit or '') == '' then bucket = nil end
  if bucket then
    rate, err = count_arg(rate_limit, 'rate limit')
    if err then return err end
    per, err = count_arg(rate_period, 'rate period')
    if err then return err end
    if rate < 1 or per < 1 then return redis.error_reply('BAD_ARG rate limit and period must be >= 1') end
  end
  err = lease_error(lease_key, worker, incarnation)
  if err then return err end
  if redis.call('SISMEMBER', servers_key, worker) == 0 then
    return redis.error_reply('NOT_SERVING worker ' .. worker .. ' does not serve queue ' .. q)
  end
  -- What the caller does once every check has passed and before anything of
  -- the queue is read (finish_claim.lua: its finish); its reply (a list) goes
  -- at the end of every reply below.
  local tail = before and before() or nil

  local now, now_micro = now_ms_us()
  -- Delayed tasks (retries, and tasks enqueued with a delay): the due ones
  -- move to the head, at most N per claim (O(log n) each); the reply says when
  -- the next one is due, and idle peers are woken for due ones left over.
  -- A queue that never had a priority or a delayed task pays one EXISTS here.
  local next_due = -1
  -- one call in the usual case: nothing delayed, reserved or with a
  -- priority, no persistent task and no failed attempt (the pause costs no
  -- call of its own)
  local has_delayed, has_prio, waiting, paused = false, false, false, false
  local extra, plain
  -- Q's groups (include/group.lua): their keys in the same EXISTS; a queue
  -- that never had a group pays nothing more
  local prefix = string.match(queue_key, '^(%b{}:)')
  local g_ready, g_wait, g_delayed = prefix .. 'gready:' .. q, prefix .. 'gwait:' .. q, prefix .. 'gdelayed:' .. q
  if paused_key then
    plain = redis.call('EXISTS', delayed_key, reserved_key, prio_key, paused_key, standby_key, pers_key,
      attempts_key, g_ready, g_wait, g_delayed) == 0
  else
    plain = redis.call('EXISTS', delayed_key, reserved_key, prio_key, standby_key, pers_key,
      attempts_key, g_ready, g_wait, g_delayed) == 0
  end
  local has_groups = not plain and redis.call('EXISTS', g_ready, g_wait, g_delayed) > 0
  local groups = has_groups and group_lib() or nil
  local G = has_groups and groups.keys(prefix, q) or nil
  if G then
    -- which of the waiting and delayed sets exist: their reads are skipped
    -- in the usual case of groups with neither (two calls save four)
    G.has_wait = redis.call('EXISTS', g_wait) == 1
    G.has_delayed = redis.call('EXISTS', g_delayed) == 1
  end
  if plain then
    extra = 0
  elseif paused_key then
    extra = redis.call('EXISTS', delayed_key, reserved_key, prio_key, paused_key)
  else
    extra = redis.call('EXISTS', delayed_key, reserved_key, prio_key)
  end
  if extra > 0 then
    has_delayed = redis.call('EXISTS', delayed_key) == 1
    has_prio = redis.call('EXISTS', prio_key) == 1
    paused = paused_key ~= nil and redis.call('EXISTS', paused_key) == 1
    waiting = extra > (has_delayed and 1 or 0) + (has_prio and 1 or 0) + (paused and 1 or 0)  -- reserved
  end
  if has_delayed then
    local due = redis.call('ZRANGEBYSCORE', delayed_key, '-inf', now, 'LIMIT', 0, n)
    local leveled = redis.call('EXISTS', dprio_key) == 1
    for i = #due, 1, -1 do
      redis.call('ZREM', delayed_key, due[i])
      local level = leveled and tonumber(redis.call('HGET', dprio_key, due[i]) or '0') or 0
      if level > 0 then
        redis.call('HDEL', dprio_key, due[i])
        prio_add(prio_key, level, {due[i]}, true)
        has_prio = true
      else
        redis.call('LPUSH', queue_key, due[i])
      end
    end
    local first = redis.call('ZRANGE', delayed_key, 0, 0, 'WITHSCORES')
    if #first > 0 then
      next_due = math.max(0, tonumber(first[2]) - now)
      if next_due == 0 and not paused then
        wake_idle(idle_key, wake_prefix, q, redis.call('ZCOUNT', delayed_key, '-inf', now))
      end
    end
  end

  if has_groups and G.has_delayed then
    local gdue = groups.due(G, now, n)
    if gdue >= 0 and (next_due < 0 or gdue < next_due) then next_due = gdue end
  end

  local tokens
  if bucket then
    tokens = rate_tokens(bucket, rate, per, now)
    if tokens < 1 then
      redis.call(wake and 'SADD' or 'SREM', idle_key, worker)
      if has_prio or redis.call('LLEN', queue_key) > 0 then next_due = rate_wait(tokens, rate, per) end
      return claim_reply({now, 0, next_due}, tail, compact)
    end
    n = math.min(n, math.floor(tokens))
  end

  -- Tasks reserved for W by a rebalance go to the head, taken first (the
  -- fair share does not hold them back: they were moved to W to even it out).
  local forced, forced_list = {}, {}
  if waiting and redis.call('EXISTS', reserved_key) == 1 then
    local _, mine = expire_reserved(reserved_key, queue_key, pers_key, standby_key, now, worker)
    for i = math.min(#mine, n), 1, -1 do
      redis.call('HDEL', reserved_key, mine[i])
      redis.call('LPUSH', queue_key, mine[i])
      forced[mine[i]] = true
      forced_list[#forced_list + 1] = mine[i]
    end
  end

  -- Q's groups and its ungrouped tasks take turns (include/group.lua):
  -- what the groups take is `gtaken`, and the ungrouped tasks (reserved,
  -- with a priority, then the list) get `n` of the claim's places.
  local n_all, gtaken, ggroups, glevels = n, nil, nil, nil  -- (no table made without groups)
  if has_groups and not paused and n > #forced_list then
    local ungrouped = redis.call('LLEN', queue_key) - #forced_list + (has_prio and redis.call('ZCARD', prio_key) or 0)
    local turns, gwait
    gtaken, ggroups, turns, gwait, glevels = groups.claim(G, n - #forced_list, now, ungrouped)
    n = #forced_list + turns
    if gwait >= 0 and (next_due < 0 or gwait < next_due) then next_due = gwait end
  end

  -- Tasks with a priority first (after those reserved for W), then the list.
  local take = {}
  if has_prio and not paused and n > #forced_list then
    local z = redis.call('ZPOPMIN', prio_key, n - #forced_list)
    for i = 1, #z, 2 do take[#take + 1] = {string.sub(z[i], 17), false, -tonumber(z[i + 1])} end
  end
  local items = {}
  local want = n - #take
  if paused then  -- only persistent tasks start: look at the first 1000 queued
    want = redis.call('EXISTS', standby_key, pers_key) > 0 and 1000 or 0
  end
  if want > 0 then items = redis.call('LPOP', queue_key, want) or {} end
  if #items == 0 and #take == 0 and not (gtaken and #gtaken > 0) then
    redis.call(wake and 'SADD' or 'SREM', idle_key, worker)
    return claim_reply({now, 0, next_due}, tail, compact)
  end

  -- without persistent tasks, nothing popped is persistent and the fair share
  -- does not matter; one call in the usual case: neither persistent tasks nor
  -- failed attempts
  local has_persistent, has_attempts = false, false
  if not plain and redis.call('EXISTS', standby_key, pers_key, attempts_key) > 0 then
    has_persistent = redis.call('EXISTS', standby_key, pers_key) > 0
    has_attempts = redis.call('EXISTS', attempts_key) == 1
  end
  local room = #items
  -- weights other than 1 only where the share hash counts tasks of such weights
  local weighted = has_persistent and redis.call('HEXISTS', share_key, ':heavy') == 1
  if has_persistent and fair ~= '0' then
    local total, capacity, mine, extra = fair_share(share_key, worker)
    room = total * mine / capacity - redis.call('SCARD', held_key) - extra
  end
  -- left: what goes back to the head, in order; held: those of them the
  -- fair share held back (the others are one-shot tasks of a paused queue)
  local left, held, gained = {}, 0, 0
  -- what to take, in order: payload, persistent, priority level (nil: none)
  local tp, tpers, tlevel = {}, {}, {}
  for i, t in ipairs(take) do tp[i], tpers[i], tlevel[i] = t[1], t[2], t[3] end
  if #tp == 0 and not has_persistent then
    tp = items  -- the usual case: all of them, none persistent
    items = {}
  end
  -- Which popped payloads are persistent tasks (include/is_queued_persistent.lua
  -- for all of them at once): one HMGET of the persistent hash, and one
  -- SMISMEMBER of the standby set for those the hash does not hold (a call
  -- per payload cost Redis several times the work it did).
  local queued_p = {}
  if has_persistent and #items > 0 then
    local vals = hmget_all(pers_key, items)
    local ask, at = {}, {}
    for i = 1, #items do
      if vals[i] then
        queued_p[i] = vals[i] == ''
      else
        ask[#ask + 1] = items[i]
        at[#ask] = i
      end
    end
    for c = 1, #ask, 1000 do
      local m = redis.call('SMISMEMBER', standby_key, unpack(ask, c, math.min(c + 999, #ask)))
      for j = 1, #m do queued_p[at[c + j - 1]] = m[j] == 1 end
    end
  end
  -- With a patience, which of the tasks from the first over the share on have
  -- had no owner for that long: one ZMSCORE, only once the share is reached.
  local waited = false
  for i, payload in ipairs(items) do
    local persistent = queued_p[i] or false
    local over = persistent and room <= 0 and not forced[payload]
    local stay = paused and (not persistent or #tp >= n)
    over = over and not stay
    if over and patience > 0 then
      if not waited then
        waited = {}
        local since = redis.call('ZMSCORE', unowned_key, unpack(items, i))
        for j = 1, #since do waited[i + j - 1] = since[j] and tonumber(since[j]) <= now - patience end
      end
      over = not waited[i]
    end
    if stay then
      left[#left + 1] = payload
    elseif over then
      left[#left + 1] = payload
      held = held + 1
    else
      if persistent then
        local w = weighted and task_weight(share_key, payload) or 1
        room = room - w
        gained = gained + w - 1
      end
      tp[#tp + 1] = payload
      tpers[#tp] = persistent
    end
  end
  for i = #left, 1, -1 do redis.call('LPUSH', queue_key, left[i]) end
  -- the jobs the groups gave, after the ungrouped ones (a group's job's
  -- record kind names its group: include/record.lua)
  local tgroup = false
  if gtaken then
    tgroup = {}
    for i, payload in ipairs(gtaken) do
      tp[#tp + 1] = payload
      tpers[#tp] = false
      tgroup[#tp] = ggroups[i]
      tlevel[#tp] = glevels[i] or 0
    end
  end
  n = n_all

  local out = {now, held > 0 and -1 or (paused and 0 or redis.call('LLEN', queue_key)), next_due}
  if has_prio and not paused and out[2] >= 0 then out[2] = out[2] + redis.call('ZCARD', prio_key) end
  if has_groups and not paused and out[2] >= 0 then out[2] = out[2] + redis.call('ZCARD', G.ready) end
  if wake and held == 0 and #tp < n then
    redis.call('SADD', idle_key, worker)
  else
    redis.call('SREM', idle_key, worker)
  end
  -- Held back: peers under their share may be idle and were not woken (the
  -- wake went to us). Each held-back server leaves the set, so the chain ends.
  if held > 0 then wake_idle(idle_key, wake_prefix, q, held) end
  if #tp == 0 then return claim_reply(out, tail, compact) end
  if bucket then
    tokens = tokens - #tp
    redis.call('HSET', bucket, 'tokens', tostring(tokens), 'at', now)
    redis.call('PEXPIRE', bucket, per + 1000)  -- full again by then anyway
    if tokens < 1 and out[2] ~= 0 then
      local wait = rate_wait(tokens, rate, per)
      if out[3] < 0 or wait < out[3] then out[3] = wait end
    end
  end
  add_share(share_key, 'h' .. worker, gained)
  -- exact past 2^53: decimal strings (include/id_strings.lua)
  local first = dec_max(dec_succ(redis.call('GET', token_key) or '0'), string.format('%.0f', now_micro))
  local ids = id_strings(first, #tp)
  redis.call('SET', token_key, ids[#ids])
  -- One HSET of every record and one SADD of every id, not one of each per
  -- process; the fields that every record of this claim shares are joined
  -- once (the record layout: include/record.lua).
  local shared = '\0' .. max_att .. '\0' .. backoff .. '\0' .. backoff_cap .. '\0' .. ttl .. '\0'
    .. string.format('%.0f', now) .. '\0'
  local records = {}
  local head = worker .. '\0'
  -- The writes of the persistent tasks taken, and the reads of the failed
  -- attempts, one variadic call each for the whole claim.
  local running, pers = {}, {}
  local failed = has_attempts and hmget_all(attempts_key, tp) or nil
  local mixed = false
  local gkinds = tgroup and {} or nil  -- group -> its record kind 'g0' .. group, made once
  for i, payload in ipairs(tp) do
    local persistent, level = tpers[i], tlevel[i]
    local id = ids[i]
    if persistent then
      pers[#pers + 1] = payload
      running[#running + 1] = payload
      running[#running + 1] = id
    end
    local attempts, a = 0, '0'
    if failed and failed[i] then
      a = failed[i]
      attempts = tonumber(a)
    end
    local kind = persistent and 'p' or 'o'
    -- (a level as its digit's byte: `.. level` would print a float)
    if level and level > 0 then kind = 'o' .. string.char(48 + level) end
    if tgroup and tgroup[i] then
      local g = tgroup[i]
      if level and level > 0 then
        kind = 'g' .. string.char(48 + level) .. g
      else
        kind = gkinds[g]
        if not kind then
          kind = 'g0' .. g
          gkinds[g] = kind
        end
      end
    end
    records[2 * i - 1] = id
    records[2 * i] = head .. kind .. '\0' .. a .. shared .. payload
    if compact then
      out[6 + i] = payload
      if persistent or attempts ~= 0 then mixed = true end
    else
      local o = 4 * i
      out[o] = id
      out[o + 1] = tgroup and tgroup[i] or (persistent and 1 or 0)
      out[o + 2] = attempts
      out[o + 3] = payload
    end
  end
  call_chunked('SREM', standby_key, pers)
  call_chunked('HSET', pers_key, running, 2)
  call_chunked('ZREM', unowned_key, pers)
  call_chunked('HSET', procs_key, records, 2)
  call_chunked('SADD', held_key, ids)
  if compact then
    out[4], out[5], out[6] = ids[1], #tp, mixed and 1 or 0
    if mixed then
      local o = 6 + #tp
      for i = 1, #tp do
        out[o + 2 * i - 1] = tgroup and tgroup[i] or (tpers[i] and 1 or 0)
        out[o + 2 * i] = failed and failed[i] and tonumber(failed[i]) or 0
      end
    elseif tgroup and #gtaken > 0 then
      -- one-shot tasks on their first attempt, some of groups: each run of
      -- processes of one group as {group ("": none), count} (a group's
      -- jobs come in runs of its turn: far fewer items than two per process)
      out[6] = 2
      local o, run, count = #out, tgroup[1] or '', 0
      for i = 1, #tp do
        local g = tgroup[i] or ''
        if g ~= run then
          out[o + 1], out[o + 2], o = run, count, o + 2
          run, count = g, 0
        end
        count = count + 1
      end
      out[o + 1], out[o + 2] = run, count
    end
  end
  return claim_reply(out, tail)
end
