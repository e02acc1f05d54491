--[[
  cancel: mark one message of a session cancelled, found by its msg_id. Durable (a key of the
  session, kept DIALOG_DEDUPE_TTL_S) and idempotent (a second cancel finds the same mark).
  The mark is what every other script checks: intake, resume and commit's hand-off end a
  marked message in its turn without a step; a commit of a marked message is refused
  (CANCELLED) and the worker commits it as cancelled; the worker running the message's step
  watches the marks of the steps it runs and stops the step. A message that already ended is
  left as it is: the answer says so.

  KEYS[1] session key prefix ("<prefix>:{<tag>}:s:")
  ARGV[1] session_id   ARGV[2] msg_id   ARGV[3] how long the mark is kept (s)

  Returns {status, seq, outcome}
    'cancelled', seq, ''   the message is outstanding (waiting or running): it will end
                           cancelled (one cancelled reply event)
    'finished', seq, outcome  it already ended (outcome 'cancelled', 'superseded',
                           'budget_exceeded' or 'expired' when its history turn says so,
                           else '': applied or dead-lettered)
    'pending', 0, ''       no message with this msg_id is outstanding that this script can
                           find (not arrived yet, or sent without a msg_id): the mark ends it
                           cancelled if it is outstanding or arrives while the mark is kept;
                           one waiting as a timer (deliver_at) keeps it until it is due + ttl
]]
local sprefix = KEYS[1]
local sid, msg_id, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
if not ttl or ttl < 1 or #sid == 0 or #msg_id == 0 or #sid > 256 or #msg_id > 256 then
  return redis.error_reply('ERR cancel: bad arguments')
end
local state = session_key(sprefix, sid, 'state')
local err = expect_type(state, 'hash')
if err then return err end

local mark = cancel_key(sprefix, sid, msg_id)
local seq = tonumber(redis.pcall('GET', session_key(sprefix, sid, 'msg:' .. msg_id)))
local h = rcall('HMGET', state, 'a', 'd')
local applied = tonumber(h[1]) or 0

if seq and seq > applied then
  -- Unpacked here, not with load_message: a value from before custody names a stream entry,
  -- and this script declares no stream (such a message is answered 'pending').
  local ok, id, fields = pcall(cmsgpack.unpack, rcall('HGET', state, 'q' .. seq) or '')
  if ok and type(id) == 'string' and type(fields) == 'table' and msg_id_of(id, fields) == msg_id then
    rcall('SET', mark, now_ms(), 'EX', ttl)
    note_cancel(sprefix)  -- it may be running: the workers' watch looks at the marks
    return {'cancelled', seq, ''}
  end
end
if rcall('EXISTS', mark) == 1 then
  return {'pending', 0, ''}  -- marked before: the same answer (idempotent)
end

-- Ended already? Its history turn says so while the history keeps it.
local ok, doc = pcall(cjson.decode, h[2] or '')
if ok and type(doc) == 'table' and type(doc['history']) == 'table' then
  for i = #doc['history'], 1, -1 do
    local turn = doc['history'][i]
    if type(turn) == 'table' and turn['msg_id'] == msg_id and type(turn['seq']) == 'number' then
      local outcome = ''
      if turn['cancelled'] == true then outcome = 'cancelled'
      elseif turn['superseded'] == true then outcome = 'superseded'
      elseif turn['budget_exceeded'] == true then outcome = 'budget_exceeded'
      elseif turn['expired'] == true then outcome = 'expired' end
      return {'finished', turn['seq'], outcome}
    end
  end
end
if seq and seq <= applied then
  return {'finished', seq, ''}
end
-- A message waiting as a timer (deliver_at) is sequenced only when it is due, maybe later
-- than ttl from now: its mark is kept until then, and ttl after.
local keep = ttl
local ok, due = pcall(cmsgpack.unpack,
                      redis.pcall('HGET', session_key(sprefix, sid, 'timers'), 't:msg:' .. msg_id)
                      or '')
if ok and type(due) == 'number' and due > now_ms() then
  keep = ttl + math.ceil((due - now_ms()) / 1000)
end
rcall('SET', mark, now_ms(), 'EX', keep)
index_msg_id(sprefix, sid, msg_id, 1, now_ms() + keep * 1000, keep * 1000)  -- found by delete
return {'pending', 0, ''}
