-- include/rate.lua: rate_tokens, rate_wait; needs nothing.

-- Rate limit of a queue: a token bucket of `rate` claims per `per` ms, on the
-- Redis clock. `bucket` ({ns}:rate:<Q>) holds the tokens left (a fraction)
-- and when (ms) they were counted; it refills at rate/per tokens per ms up
-- to `rate` (so a full bucket allows a burst of `rate` claims), and a
-- missing bucket is full. Returns the tokens there are at `now`.
local function rate_tokens(bucket, rate, per, now)
  local b = redis.call('HMGET', bucket, 'tokens', 'at')
  if not b[1] then return rate end
  return math.min(rate, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * rate / per)
end

-- The ms until `tokens` (fewer than one) have grown to one token.
local function rate_wait(tokens, rate, per)
  return math.max(1, math.ceil((1 - tokens) * per / rate))
end
