--[[
  land: an attempt's usage is in the usage counters (its commit wrote them with its reply, or
  they were counted as wasted): the holds of its model calls on the tenant's budget meter go
  (lua/reserve-2.lua, lua/spend-2.lua), since the counters now hold what they used. Sent twice,
  the second call finds nothing to drop.

  KEYS[1] budget meter   KEYS[2] leases

  ARGV[1..n] the attempt's call ids (1 to 1000)

  Returns the tokens still held on the meter (reserved).
]]
local meter, leases = KEYS[1], KEYS[2]
if #ARGV < 1 or #ARGV > 1000 then return redis.error_reply('ERR land: bad arguments') end
for _, id in ipairs(ARGV) do
  if id == '' or #id > 1024 then return redis.error_reply('ERR land: bad arguments') end
end
local err = expect_types({{meter, 'hash'}, {leases, 'zset'}})
if err then return err end

local held = tonumber(rcall('HGET', meter, 'reserved')) or 0
for _, id in ipairs(ARGV) do
  local hold = rcall('HGET', meter, 'r:' .. id)
  if hold then
    held = rcall('HINCRBY', meter, 'reserved', -(tonumber(string.match(hold, '(%d+)$')) or 0))
    rcall('HDEL', meter, 'r:' .. id)
    rcall('ZREM', leases, id)
  end
end
return held
