-- finish_claim.lua: a worker reports processes as finished and claims up to
-- N tasks of the same queue, in one atomic step: finish.lua, then
-- claim.lua, with one lease check and one script call instead of two (a
-- busy runner's round trip). The finish runs after every check of the
-- claim has passed, so an error reply means nothing at all was written.
--
-- KEYS[1] .. KEYS[19] as claim.lua's (KEYS[18] {ns}:rate:<Q> and KEYS[19]
--            {ns}:paused:<Q> are not optional here)
-- KEYS[20] {ns}:awaiting:<Q>     as finish.lua's KEYS[7]: a done message is
--                                published only while it exists
-- ARGV[1] .. ARGV[13] as claim.lua's (ARGV[12] and ARGV[13] "" for no rate limit)
-- ARGV[14] the done channel of Q ({ns}:done:<Q>)
-- ARGV[15..] the ids of the processes to finish (as finish.lua's ARGV[4..])
-- Returns: claim.lua's reply in a compact form (include/claim_run.lua):
--          {now_ms, tasks left (-1: some were left for peers by the fair
--          share), ms until the first delayed task is due (-1: none), the
--          first process id ("" when none), c (how many processes), mixed
--          (0/1/2), then the c payloads, then, if mixed is 1, per process
--          its persistent flag (1/0, or a group's job's group name) and
--          failed attempts so far; if mixed is 2, per run of processes of
--          one group its group ("": none) and length}: process i (from 0)
--          has id first + i; with mixed 0 every process is an ungrouped
--          one-shot task on its first attempt, with 2 a one-shot task on
--          its first attempt. Then per process id to finish
--          (in ARGV's order) 1 if it was W's live process and is now
--          finished, else 0 (as finish.lua's reply): the caller knows how
--          many it sent.
-- Errors: as claim.lua's (FENCED, NOT_SERVING, BAD_ARG; and at the memory
--         limit, when nothing was finished and the claim's first write is
--         refused); then nothing was finished either.
-- Times: as finish.lua (include/enqueue_time.lua).
-- Publishes: as finish.lua (the done messages, before the claim's) and as
--            claim.lua.
--!include include/claim_run.lua
--!include include/finish_process.lua

if #KEYS ~= 20 then return redis.error_reply('BAD_ARG expected 20 keys') end
return claim_run(KEYS, ARGV, function()
  local ids = {}
  for i = 15, #ARGV do ids[#ids + 1] = ARGV[i] end
  local flags = {}
  if #ids > 0 then
    finish_begin(ARGV[1], KEYS[5], KEYS[6], KEYS[4], KEYS[7], KEYS[15], KEYS[20], ARGV[14], false)
    flags = finish_all(ids, hmget_all(KEYS[5], ids))
    finish_writes()
  end
  return flags
end, true)
