--[[
  reserve: before a model call, a tenant's daily token budget is asked for the call's
  estimate. Granted when what the tenant spent today, plus what its calls in flight reserved,
  plus this estimate stays within the budget; the estimate is then reserved until the call
  settles (lua/spend-2.lua) or its lease lapses (a crashed caller's reservation comes back).
  So concurrent calls pass the budget by at most what they use beyond their estimates.

  KEYS[1] budget meter (hash: spent, reserved, r:<call id>)   KEYS[2] leases (call id -> end)

  ARGV[1] call id   ARGV[2] estimated tokens   ARGV[3] budget (tokens, > 0)
  ARGV[4] lease (ms)   ARGV[5] keep the meter (s)

  Returns {1 granted | 0 refused, spent, reserved (this one's included when granted)}.
]]
local meter, leases = KEYS[1], KEYS[2]
local id, estimate, budget, lease, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4]), tonumber(ARGV[5])
if id == '' or #id > 1024 or not (estimate and budget and lease and keep) or estimate < 0
    or estimate > 1e12 or math.floor(estimate) ~= estimate or budget < 1 or lease < 1 or keep < 1 then
  return redis.error_reply('ERR reserve: bad arguments')
end
local err = expect_types({{meter, 'hash'}, {leases, 'zset'}})
if err then return err end

local now = now_ms()
-- Reservations of callers that never settled (crashed) come back.
local lapsed = rcall('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 100)
for _, old in ipairs(lapsed) do
  local tokens = tonumber(rcall('HGET', meter, 'r:' .. old)) or 0
  rcall('HDEL', meter, 'r:' .. old)
  rcall('ZREM', leases, old)
  rcall('HINCRBY', meter, 'reserved', -tokens)
end
local h = rcall('HMGET', meter, 'spent', 'reserved', 'r:' .. id)
local spent, held = tonumber(h[1]) or 0, tonumber(h[2]) or 0
if h[3] then return {1, spent, held} end  -- sent twice: reserved already
if spent + held + estimate > budget then return {0, spent, held} end
rcall('HINCRBY', meter, 'reserved', estimate)
rcall('HSET', meter, 'r:' .. id, estimate)
rcall('ZADD', leases, now + lease, id)
rcall('EXPIRE', meter, keep)
rcall('EXPIRE', leases, keep)
return {1, spent, held + estimate}
