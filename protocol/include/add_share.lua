-- include/add_share.lua: add_share; needs nothing.

-- The share hash {ns}:share:<Q> (":weight" T, ":capacity" C, ":heavy",
-- "w" .. payload, "c" .. W, "h" .. W, ":gen"; a field is left out while it
-- would hold 0 or its default) is described under Names in README.md. The
-- sums are kept by the scripts that change them, so fair_share reads one HMGET.

-- Add `delta` to a whole-number field of the share hash, which is left out
-- when it comes to 0; a change moves the generation ':gen' on (heartbeat.lua
-- reads the share again only when it moved).
local function add_share(share, field, delta)
  if delta ~= 0 then
    if redis.call('HINCRBY', share, field, delta) == 0 then redis.call('HDEL', share, field) end
    redis.call('HINCRBY', share, ':gen', 1)
  end
end
