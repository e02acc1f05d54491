--[[
  renew: the heartbeat of a message whose step is still running. Extends the lock if it is
  still ours and keeps the message itself from looking abandoned: a stream entry is claimed
  again by its own consumer (XCLAIM JUSTID resets its idle time without counting a delivery),
  a handed-off delayed message gets its lease pushed back.

  KEYS[1] session lock   KEYS[2] inbound stream   KEYS[3] delayed set

  ARGV[1] token   ARGV[2] lock ttl (ms)   ARGV[3] group   ARGV[4] consumer
  ARGV[5] source ("s" | "d")   ARGV[6] source id

  Returns 1 (renewed) or 0 (the lease is lost: the result must be given up).
]]
local rcall = redis.call

if rcall('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
rcall('PEXPIRE', KEYS[1], ARGV[2])
if ARGV[5] == 's' then
  rcall('XCLAIM', KEYS[2], ARGV[3], ARGV[4], 0, ARGV[6], 'JUSTID')
else
  local t = rcall('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  rcall('ZADD', KEYS[3], 'XX', now + tonumber(ARGV[2]), ARGV[6])
end
return 1
