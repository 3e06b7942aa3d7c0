-- include/nudge.lua: nudge; needs nothing.

-- Publish `message` on `channel`, a channel of the namespace (its name starts
-- with `{ns}:`, so it hashes to the namespace's slot). Sharded (SPUBLISH) where
-- the server has it (Redis 7.0+: `redis.REDIS_VERSION_NUM` is set) and the
-- user may run it: on a cluster it reaches the nodes of the namespace's shard
-- only, where PUBLISH is sent over the cluster bus to every node. Otherwise
-- (6.2, or an ACL without `spublish`) PUBLISH. Subscribers listen both ways
-- (SSUBSCRIBE where they can, and SUBSCRIBE): see Channels in README.md.
local function nudge(channel, message)
  if redis.REDIS_VERSION_NUM and pcall(redis.call, 'SPUBLISH', channel, message) then return end
  redis.call('PUBLISH', channel, message)
end
