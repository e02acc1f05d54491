--[[
  resolve: a person answers a parked interrupt (DialogClient.resume), or a cancel of a parked
  message must be looked at now. Run by the application: it touches only the session's await
  key and its interrupts (see _common.lua), the ready set, the ages and the kick list, never
  the state hash nor a journal (those are the workers').

  Applied once: a resume counts only while its interrupt is the one the session's await key
  holds, and it deletes that key in the same step, so a second resume of the same id finds
  nothing to apply (it is told how the interrupt ended).

    resume  the value is recorded as the interrupt's end (interrupts: id -> {"value": ...},
            where the re-run's interrupt() finds it), the await key goes, the session is put
            in the ready set due now (and the ages), and the workers' resumers are woken
            (kick in _common.lua); resume-3.lua then hands the message out again
    wake    after a cancel of msg_id (cancel-1.lua marked it): if the session is parked on
            that message, it is put in the ready set due now, where resume-3.lua ends it
            cancelled (unparked, without a step)

  KEYS[1] ready set   KEYS[2] session key prefix

  ARGV[1] resume | wake   ARGV[2] session_id
  resume: ARGV[3] interrupt id   ARGV[4] value (JSON text)
  wake:   ARGV[3] msg_id

  Returns
    resume  {'resumed'} | {'ended', how JSON} (it ended before: {"value": ...} resumed,
            {"timeout": true}, {"ended": "cancelled" | "superseded"}; kept a day) |
            {'unknown'} (no such interrupt: a wrong id, or the session was reset or deleted)
    wake    {'woken'} | {'not_parked'}
]]
local ready, sprefix = KEYS[1], KEYS[2]
local op, sid = ARGV[1], ARGV[2]
if not ((op == 'resume' and #ARGV == 4 and #ARGV[4] > 0) or (op == 'wake' and #ARGV == 3))
    or #sid == 0 or #sid > 256 or #ARGV[3] == 0 or #ARGV[3] > 1024 then
  return redis.error_reply('ERR resolve: bad arguments')
end
local await = await_key(sprefix, sid)
local interrupts = session_key(sprefix, sid, 'interrupts')
local err = expect_types({{ready, 'zset'}, {ages_key(ready), 'zset'}, {await, 'string'},
  {interrupts, 'hash'}, {ready .. ':kick', 'list'}})
if err then return err end

local rec = interrupt_record(rcall('GET', await))
local now = now_ms()

if op == 'wake' then
  if rec['msg_id'] ~= ARGV[3] then return {'not_parked'} end
  rcall('ZADD', ready, now, sid)
  kick(ready)
  return {'woken'}
end

local id, value = ARGV[3], ARGV[4]
if rec['id'] ~= id then
  local how = rcall('HGET', interrupts, id)
  if how then return {'ended', how} end
  return {'unknown'}
end
local ok = pcall(cjson.decode, value)
if not ok then return redis.error_reply('ERR resolve: the value is not JSON') end
interrupt_ended(sprefix, sid, id, '{"value":' .. value .. '}')
rcall('DEL', await)
rcall('ZADD', ready, now, sid)
rcall('ZADD', ages_key(ready), entry_ms(tostring(rec['entry_id'] or '')), sid)
kick(ready)
return {'resumed'}
