-- include/wake_idle.lua: wake_idle; needs:
--!include include/nudge.lua

-- Tasks of queue Q became ready: wake up to `ready` + 1 of Q's idle servers
-- ({ns}:idle:<Q>: workers serving Q with a free slot whose last claim found
-- nothing to take). Each is removed from the set and gets the queue name on
-- its wake channel; it claims, and goes back into the set if it finds
-- nothing. Busy servers are not woken: they claim again when a slot frees.
-- One spare: a woken server may be held back by the fair share, or its
-- message lost (its heartbeat then brings the news, within H).
-- Call it before a script writes any task, where the count is known by then:
-- writes are not rolled back, so a refused SPOP or PUBLISH (an ACL without
-- them) then adds no task (a refused SPUBLISH falls back to PUBLISH). Nobody can claim before the script ends.
-- SPOP is not refused at the memory limit: a script that adds tasks writes
-- a "denyoom" command before it (see "At the memory limit" in README.md).
-- Returns how many were woken.
local function wake_idle(idle, wake_prefix, queue, ready)
  if ready <= 0 then return 0 end
  local ws = redis.call('SPOP', idle, ready + 1)
  for _, w in ipairs(ws) do nudge(wake_prefix .. w, queue) end
  return #ws
end
