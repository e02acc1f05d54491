--[[
  resolve: a person answers a parked interrupt (DialogClient.resume), or a cancel of a parked
  message must be looked at now. Applied once: a resume counts only while its interrupt is
  the one the session is parked on, and it unparks the session in the same step, so a second
  resume of the same id finds nothing to apply (it is told how the interrupt ended).

    resume  the value is recorded in the message's journal (i:<n>, where the re-run's n-th
            interrupt() finds it), the session is unparked, put in the ready set due now and
            the workers' resumers are woken (kick in _common.lua)
    wake    after a cancel of msg_id (cancel-1.lua marked it): if the session is parked on
            that message, it is put in the ready set due now, where resume-3.lua ends it
            cancelled (unparked, without a step)

  KEYS[1] ready set   KEYS[2] session key prefix

  ARGV[1] resume | wake   ARGV[2] session_id
  resume: ARGV[3] interrupt id   ARGV[4] value (JSON text)   ARGV[5] journal expiry (s)
  wake:   ARGV[3] msg_id

  Returns
    resume  {'resumed'} | {'ended', how} (it ended before: resumed, timed_out or cancelled;
            kept a day) | {'unknown'} (no such interrupt is parked: a wrong id, or the session
            was reset or deleted)
    wake    {'woken'} | {'not_parked'}
]]
local ready, sprefix = KEYS[1], KEYS[2]
local op, sid = ARGV[1], ARGV[2]
if not ((op == 'resume' and #ARGV == 5 and tonumber(ARGV[5]) and tonumber(ARGV[5]) >= 1
          and #ARGV[4] > 0)
        or (op == 'wake' and #ARGV == 3))
    or #sid == 0 or #sid > 256 or #ARGV[3] == 0 or #ARGV[3] > 1024 then
  return redis.error_reply('ERR resolve: bad arguments')
end
local state = session_key(sprefix, sid, 'state')
local interrupts = session_key(sprefix, sid, 'interrupts')
local err = expect_streams({ready .. ':kick'}) or expect_types({{ready, 'zset'},
  {ages_key(ready), 'zset'}, {timers_key(ready), 'zset'}, {state, 'hash'}, {interrupts, 'hash'}})
if err then return err end

local h = rcall('HMGET', state, 'w', 'wi')
local now = now_ms()

if op == 'wake' then
  if h[1] ~= ARGV[3] then return {'not_parked'} end
  rcall('ZADD', ready, now, sid)
  kick(ready)
  return {'woken'}
end

local id, value = ARGV[3], ARGV[4]
local rec = h[1] and interrupt_record(h[2]) or {}
if rec['id'] ~= id then
  local how = rcall('HGET', interrupts, id)
  if how then return {'ended', how} end
  return {'unknown'}
end
local ok = pcall(cjson.decode, value)
if not ok then return redis.error_reply('ERR resolve: the value is not JSON') end
local journal = journal_key(sprefix, sid, h[1])
local jt = redis.pcall('TYPE', journal)
if type(jt) ~= 'table' or (jt['ok'] ~= 'none' and jt['ok'] ~= 'hash') then
  return redis.error_reply('WRONGTYPE ' .. journal .. ' is not a hash')
end
rcall('HSET', journal, 'i:' .. (tonumber(rec['n']) or 1), '{"value":' .. value .. '}')
rcall('EXPIRE', journal, tonumber(ARGV[5]))
unpark(ready, sprefix, sid, rec, 'resumed')
rcall('ZADD', ready, now, sid)
kick(ready)
return {'resumed'}
