--[[
  spend: a call's tokens go on its tenant's budget meter of the day, and its reservation
  (lua/reserve-2.lua) is given back. With a call id, keyed by it: sent twice, or after its
  lease lapsed (the reservation already gone), it adds nothing. Without one ('': usage
  reported outside a reserved call, added after its attempt) the tokens are added as they are.

  KEYS[1] budget meter   KEYS[2] leases

  ARGV[1] call id or ''   ARGV[2] tokens used   ARGV[3] keep the meter (s)

  Returns the tokens spent today after this.
]]
local meter, leases = KEYS[1], KEYS[2]
local id, used, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if #id > 1024 or not (used and keep) or used < 0 or used > 1e12 or keep < 1 then
  return redis.error_reply('ERR spend: bad arguments')
end
local err = expect_types({{meter, 'hash'}, {leases, 'zset'}})
if err then return err end

if id ~= '' then
  if rcall('ZREM', leases, id) == 0 then
    return tonumber(rcall('HGET', meter, 'spent')) or 0
  end
  local tokens = tonumber(rcall('HGET', meter, 'r:' .. id)) or 0
  rcall('HDEL', meter, 'r:' .. id)
  rcall('HINCRBY', meter, 'reserved', -tokens)
end
local spent = rcall('HINCRBY', meter, 'spent', math.floor(used))
rcall('EXPIRE', meter, keep)
return spent
