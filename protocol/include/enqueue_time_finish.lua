-- include/enqueue_time_finish.lua: enqt_watch, with its state enqt_fin and
-- enqt_fin_gone (the enqueue times a finish removes: see
-- include/enqueue_time.lua); needs nothing.

-- A finish call (include/finish_process.lua): its queue's key while it
-- holds times, else false; and the payloads of the one-shot jobs it
-- finished, whose times its finish_writes removes (one ZREM).
local enqt_fin, enqt_fin_gone

-- Begin a finish call on the queue whose process hash is `procs` (one
-- EXISTS): sets enqt_fin, and enqt_fin_gone to an empty list (nil when
-- the queue holds no times).
local function enqt_watch(procs)
  local prefix = string.match(procs, '^(%b{}:)')
  local key = prefix .. 'enqt:' .. string.sub(procs, #prefix + 7)
  enqt_fin = redis.call('EXISTS', key) == 1 and key
  enqt_fin_gone = enqt_fin and {} or nil
end
