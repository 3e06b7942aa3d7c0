-- include/lease_error.lua: lease_error; needs nothing.

-- nil if `worker` holds the lease stored at `key` under `incarnation`, else an
-- error reply to return at once (before any write).
local function lease_error(key, worker, incarnation)
  local v = redis.call('GET', key)
  if not v then
    return redis.error_reply('FENCED worker ' .. worker .. ' has no lease (expired or recycled)')
  end
  if v ~= incarnation then
    return redis.error_reply('FENCED worker ' .. worker .. ' lease superseded')
  end
  return nil
end
