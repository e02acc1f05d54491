--[[
  pause: close a limit key for every worker of the deployment (a provider answered 429 with
  Retry-After, or an operator paused it by hand). Every acquire of the key (lua/acquire-3.lua)
  is refused until then, and its callers are given turns after it, in order. A pause never
  shortens one already in force: paused_until only moves later.

  KEYS[1] limit hash

  ARGV[1] how long (ms)   ARGV[2] why (at most 500 bytes: kept for operators)

  Returns the ms until the key opens again (from now; the pause in force).
]]
local conf = KEYS[1]
local for_ms = tonumber(ARGV[1])
if not for_ms or for_ms < 0 or for_ms > 86400000 * 7 or #ARGV[2] > 500 then
  return redis.error_reply('ERR pause: bad arguments')
end
local err = expect_type(conf, 'hash')
if err then return err end

local now = now_ms()
local until_ms = now + for_ms
local pu = tonumber(rcall('HGET', conf, 'pu')) or 0
if pu > until_ms then
  until_ms = pu
else
  rcall('HSET', conf, 'pu', until_ms, 'pr', ARGV[2], 'pa', now)
end
return until_ms - now
