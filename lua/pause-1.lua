--[[
  pause: close a limit key for every worker of the deployment (a provider answered 429, or an
  operator paused it by hand). Every acquire of the key (lua/acquire-3.lua) is refused until
  then, and its callers are given turns after it, in order. A pause never shortens one in
  force: paused_until only moves later.

  A provider's pause (ARGV[3] 'provider') does not trust the provider's Retry-After: it lasts
  at least a floor and at most a cap. The floor is ARGV[4] ms after the key's first 429 and
  doubles with each 429 that comes after the key reopened (consecutive 429s: ps, reset by a
  call that succeeds, lua/settle-2.lua, or by limits resume), up to ARGV[5]; a 429 that comes
  while the key is still paused (a call that was already under way) belongs to the same pause
  and does not move the floor. So a Retry-After of 0, a negative or unreadable one, or a date
  in the past (ARGV[1] -1: the caller found no wait in it) is no hot loop, and one of a day
  closes the key for ARGV[6] ms at most (DIALOG_MAX_PROVIDER_PAUSE_S). All on Redis time,
  for the whole fleet. An operator's pause (ARGV[3] 'operator') lasts exactly ARGV[1] ms.

  KEYS[1] limit hash

  ARGV[1] how long (ms; -1: the provider named no wait)   ARGV[2] why (at most 500 bytes:
  kept for operators)   ARGV[3] 'operator' | 'provider'
  ARGV[4] the floor's first length (ms)   ARGV[5] the floor's most (ms)
  ARGV[6] a provider's pause's most (ms)   (ARGV[4..6]: 'provider' only)

  Returns the ms until the key opens again (from now; the pause in force).
  Hash fields: pu (paused until, ms), pr (why), pa (when the pause in force began), ps (the
  provider's 429s in a row, each after the key reopened).
]]
local conf = KEYS[1]
local for_ms, kind = tonumber(ARGV[1]), ARGV[3]
local floor_ms, floor_max, cap = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local week = 86400000 * 7
if not for_ms or for_ms < -1 or for_ms > week or #ARGV[2] > 500
    or not (kind == 'operator' or kind == 'provider') then
  return redis.error_reply('ERR pause: bad arguments')
end
if kind == 'operator' and for_ms < 0 then return redis.error_reply('ERR pause: bad arguments') end
if kind == 'provider' and not (floor_ms and floor_max and cap and floor_ms >= 1
    and floor_max >= floor_ms and cap >= 1 and cap <= week) then
  return redis.error_reply('ERR pause: bad arguments')
end
local err = expect_type(conf, 'hash')
if err then return err end

local now = now_ms()
local h = rcall('HMGET', conf, 'pu', 'ps')
local pu, streak = tonumber(h[1]) or 0, tonumber(h[2]) or 0
if kind == 'provider' and pu > now then
  -- A 429 while the key is paused: a call that was under way. The same pause, unless the
  -- provider asks for longer.
  for_ms = math.min(math.max(for_ms, 0), cap)
elseif kind == 'provider' then
  streak = math.min(streak + 1, 64)  -- a 429 after the key reopened: the floor grows
  rcall('HSET', conf, 'ps', streak)
  local floor = math.min(floor_ms * 2 ^ (streak - 1), floor_max, cap)
  for_ms = math.floor(math.min(math.max(for_ms, floor), cap))
end
local until_ms = now + for_ms
if pu > until_ms then
  until_ms = pu
else
  rcall('HSET', conf, 'pu', until_ms, 'pr', ARGV[2], 'pa', now)
end
return until_ms - now
