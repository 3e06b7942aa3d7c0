-- include/next_attempt.lua: next_attempt; needs nothing.

-- A failed attempt of the process `r` (a record) whose payload had `prev`
-- failed attempts before: the count to keep (false: forget it), and where
-- the task goes: 'dead' (a one-shot task at its attempt limit), 'front' (a
-- crash-recycled task's first failure: failover at once), 'later' (after
-- `delay` ms: base * 2^(n-1), capped) or 'back' (no backoff). A persistent
-- task that ran longer than the cap before failing starts counting again;
-- so does one whose worker crashed after it had run for at least one lease
-- ttl (a crash is recycled at least ttl after it happened): a task that
-- kills its worker does so at once, a healthy one was merely unlucky.
local function next_attempt(r, now, prev, base, cap, first_at_front)
  local a
  local ran = now - r.started
  if first_at_front then ran = ran - r.ttl end
  if r.persistent and (ran > cap or (first_at_front and r.ttl > 0 and ran >= r.ttl)) then
    a = 1
  else
    a = prev + 1
  end
  if not r.persistent and r.max_attempts > 0 and a >= r.max_attempts then
    return false, 'dead', 0, a
  end
  local n = a
  if first_at_front then
    if a == 1 then return a, 'front', 0 end
    n = a - 1
  end
  local delay = math.floor(math.min(base * 2 ^ (n - 1), cap))
  if delay > 0 then return a, 'later', delay end
  return a, 'back', 0
end
