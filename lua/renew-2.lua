--[[
  renew: the heartbeat of the sessions whose steps are still running here. Extends each lock
  that is still ours and pushes its session's place in the ready set back, so nobody resumes
  a session whose holder is alive.

  KEYS[1] ready set   KEYS[2] session key prefix
  ARGV[1] lock ttl (ms), then pairs of token, session_id

  Returns one 1 (renewed) or 0 (lost: the result must be given up) per pair.
]]
local ready, sprefix = KEYS[1], KEYS[2]
local ttl = tonumber(ARGV[1])
if not ttl or #ARGV % 2 ~= 1 then
  return redis.error_reply('ERR renew: bad arguments')
end
local err = expect_type(ready, 'zset')
if err then return err end

local now = now_ms()
local results = {}
for i = 2, #ARGV, 2 do
  local lock = session_key(sprefix, ARGV[i + 1], 'lock')
  if redis.pcall('GET', lock) == ARGV[i] then
    rcall('PEXPIRE', lock, ttl)
    rcall('ZADD', ready, held_until(now, ttl, ARGV[i]), ARGV[i + 1])
    -- Its tenant counts it in flight until the new lease ends (see the tenants in _common.lua).
    local tenant = redis.pcall('HGET', session_key(sprefix, ARGV[i + 1], 'state'), 'T')
    if type(tenant) == 'string' then
      redis.pcall('ZADD', busy_key(ready, tenant), 'XX', now + ttl, ARGV[i + 1])
    end
    results[#results + 1] = 1
  else
    results[#results + 1] = 0
  end
end
return results
