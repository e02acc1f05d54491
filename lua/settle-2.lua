--[[
  settle: a model call on a limit key has ended. Its in-flight slot is given back and, when
  the caller knows the tokens the call used, the key's token rate is corrected by what it
  used minus what acquire charged (an estimate too low slows the next calls down, one too
  high speeds them up). Keyed by the call id: sent twice (a lost reply), it corrects once; a
  call whose slot had already lapsed (its lease ran out) corrects nothing. A call that
  succeeded ends the key's run of provider 429s (ps, lua/pause-1.lua): the next 429 pauses it
  for the first floor again.

  KEYS[1] limit hash   KEYS[2] in-flight set

  ARGV[1] call id   ARGV[2] tokens charged at acquire   ARGV[3] tokens used (-1: unknown)
  ARGV[4] tpm (the settings' value; the hash's tpm field wins)
  ARGV[5] "1": the call succeeded | "0": it failed (or its end is not known)

  Returns 1 when the slot was given back now, 0 when it was not in flight.
]]
local conf, in_flight = KEYS[1], KEYS[2]
local id, charged, used, default_tpm, ok = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4]), ARGV[5]
if id == '' or not (charged and used and default_tpm) or charged < 0 or used < -1
    or used > 1e12 or math.floor(used) ~= used or math.floor(charged) ~= charged
    or not (ok == '1' or ok == '0') then
  return redis.error_reply('ERR settle: bad arguments')
end
local err = expect_types({{conf, 'hash'}, {in_flight, 'zset'}})
if err then return err end

if ok == '1' then rcall('HDEL', conf, 'ps') end
if rcall('ZREM', in_flight, id) == 0 then return 0 end
if used >= 0 and used ~= charged then
  local h = rcall('HMGET', conf, 'tpm', 'tt', 'mb')
  local tpm = tonumber(h[1])
  if tpm == nil or tpm < 0 then tpm = default_tpm end
  if tpm > 0 and tonumber(h[2]) then
    rcall('HSET', conf, 'tt', tonumber(h[2]) + (used - charged) * 60000 / tpm)
  end
  if tonumber(h[3]) == math.floor(now_ms() / 60000) then
    rcall('HINCRBY', conf, 'mt', used - charged)
  end
end
return 1
