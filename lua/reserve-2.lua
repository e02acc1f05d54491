--[[
  reserve: before a model call under a tenant's daily token budget, hold the call's estimate on
  the tenant's budget meter of the day, until what the call used is counted: the call ended
  (lua/spend-2.lua: its hold becomes what it reported, or goes) and its attempt's usage is in
  the usage counters (lua/land-2.lua, after the commit or the count of a wasted attempt), or
  until its lease lapses. The caller reads the tenant's usage counters of the day after this
  call and gives the hold back at once when counters + unreported + held would pass the budget
  (dialog_worker/store/tenants.py, reserve): a hold goes only once its usage is in the counters,
  so a check that reads them after holding sees every call at least once, and calls at once pass
  the budget by at most what they use beyond their estimates.

  A lapsed hold (its worker died): a call still in flight gives its estimate back; a call that
  had ended (its reported usage, 'u<tokens>', not in the counters yet) is charged as
  unreported, so the tokens a provider was paid for are not lost with the worker.

  KEYS[1] budget meter (hash: reserved, unreported, r:<call id> = '<estimate>' | 'u<used>')
  KEYS[2] leases (call id -> when its hold lapses, ms)

  ARGV[1] call id   ARGV[2] estimated tokens   ARGV[3] lease (ms)   ARGV[4] keep the meter (s)

  Returns {unreported, reserved (this hold included)}.
]]
local meter, leases = KEYS[1], KEYS[2]
local id, estimate, lease, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4])
if id == '' or #id > 1024 or not (estimate and lease and keep) or estimate < 0
    or estimate > 1e12 or math.floor(estimate) ~= estimate or lease < 1 or keep < 1 then
  return redis.error_reply('ERR reserve: bad arguments')
end
local err = expect_types({{meter, 'hash'}, {leases, 'zset'}})
if err then return err end

local now = now_ms()
for _, old in ipairs(rcall('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 100)) do
  local hold = rcall('HGET', meter, 'r:' .. old) or ''
  local ended, tokens = string.match(hold, '^(u?)(%d+)$')
  tokens = tonumber(tokens) or 0
  rcall('HINCRBY', meter, 'reserved', -tokens)
  if ended == 'u' then rcall('HINCRBY', meter, 'unreported', tokens) end
  rcall('HDEL', meter, 'r:' .. old)
  rcall('ZREM', leases, old)
end
local h = rcall('HMGET', meter, 'unreported', 'reserved', 'r:' .. id)
local unreported, held = tonumber(h[1]) or 0, tonumber(h[2]) or 0
if h[3] then return {unreported, held} end  -- sent twice: held already
rcall('HINCRBY', meter, 'reserved', estimate)
rcall('HSET', meter, 'r:' .. id, estimate)
rcall('ZADD', leases, now + lease, id)
rcall('EXPIRE', meter, keep)
rcall('EXPIRE', leases, keep)
return {unreported, held + estimate}
