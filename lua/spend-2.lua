--[[
  spend: a model call under a tenant's budget ended (lua/reserve-2.lua held its estimate). Its
  hold becomes what it used, until its attempt's usage is in the usage counters (lua/land-2.lua)
  or its lease lapses:
    used > 0   the hold is the tokens it reported ('u<used>'): counted until the usage lands;
    used = 0   it used nothing (an outage, a refusal, a 429, a failure before any usage was
               reported): the hold goes at once, the estimate given back;
    used = -1  it succeeded without reporting what it used: charged its estimate, as unreported
               (no usage counter will ever hold it).
  Keyed by the call id: sent twice (a lost reply), after the hold lapsed or after it landed, it
  does nothing.

  KEYS[1] budget meter   KEYS[2] leases

  ARGV[1] call id   ARGV[2] tokens used (-1: not reported)   ARGV[3] keep the meter (s)

  Returns {unreported, reserved}.
]]
local meter, leases = KEYS[1], KEYS[2]
local id, used, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if id == '' or #id > 1024 or not (used and keep) or used < -1 or used > 1e12
    or math.floor(used) ~= used or keep < 1 then
  return redis.error_reply('ERR spend: bad arguments')
end
local err = expect_types({{meter, 'hash'}, {leases, 'zset'}})
if err then return err end

local h = rcall('HMGET', meter, 'r:' .. id, 'unreported', 'reserved')
local estimate = h[1] and tonumber(string.match(h[1], '^(%d+)$'))
local unreported, held = tonumber(h[2]) or 0, tonumber(h[3]) or 0
if not estimate then return {unreported, held} end  -- ended already, landed or lapsed
if used > 0 then
  rcall('HSET', meter, 'r:' .. id, 'u' .. used)
  held = rcall('HINCRBY', meter, 'reserved', used - estimate)
else
  rcall('HDEL', meter, 'r:' .. id)
  rcall('ZREM', leases, id)
  held = rcall('HINCRBY', meter, 'reserved', -estimate)
  if used < 0 then unreported = rcall('HINCRBY', meter, 'unreported', estimate) end
end
rcall('EXPIRE', meter, keep)
return {unreported, held}
