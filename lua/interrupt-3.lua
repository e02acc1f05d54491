--[[
  interrupt: a running step waits for a person (dialog_worker.interrupt). In one atomic step,
  fenced like a commit (the lock is the caller's token, and the message is the session's next
  one: applied seq = seq - 1): the session is parked on the message (the state's w and the
  session's await key, see _common.lua), a durable reply event of outcome "awaiting" carries
  the interrupt's id
  and payload, the attempt is recorded as one that ended awaiting (the journal's w: it is not
  counted against DIALOG_MAX_ATTEMPTS), and the lock is released. Nothing hands the message
  out again (resume-3.lua) until resolve-2.lua records a resume, its timeout is due (a member
  of the shard's timer set, fire-3.lua), or the message is cancelled; the session's later
  messages wait behind it, in order. The session leaves the ready set and the ages.

  The message's journal is kept while it waits: without a timeout it loses its expiry (the
  wait has no end of its own); with one it expires a journal expiry after the timeout.
  Sent again (a lost reply) it writes nothing more: the lock is gone by then (FENCED_TOKEN),
  and the caller sees the parked interrupt with pending().

  KEYS[1] ready set   KEYS[2] session key prefix   KEYS[3] reply stream

  ARGV[1] lock token   ARGV[2] session_id   ARGV[3] seq   ARGV[4] msg_id
  ARGV[5] the message's entry id   ARGV[6] interrupt id   ARGV[7] n (1 for the step's first
  interrupt() call, 2 for its second...)   ARGV[8] payload (JSON text)
  ARGV[9] timeout (ms; 0: none)   ARGV[10] reply MAXLEN (0: none)
  ARGV[11] reply extras (a JSON array of at most 64 strings in name/value pairs, echoed
  producer fields; "" for none)   ARGV[12] journal expiry (s)
  ARGV[13] the prompt's data for readers of the answer (JSON text: interrupt_id, payload)
  ARGV[14] the attempt   ARGV[15] the next position of its partial stream
  ARGV[16] partial stream MAXLEN   ARGV[17] partial stream expiry (s)

  Readers of the message's streamed answer get the prompt in the same step: an event entry
  ("v", kind "awaiting", as emit-2.lua writes a step's events) at the attempt's next
  position of the message's partial stream, so a page never shows a prompt that cannot be
  answered yet. A stream that refuses that id (it holds a later attempt) is left as it is.

  Returns
    {10 PARKED, timeout_at (ms; 0: none)}   written
    {-1 FENCED_TOKEN}     the lock is not the caller's: nothing written
    {-2 FENCED_VERSION}   the message is not the session's next one, or another message
                          of the session waits already: nothing written
]]
local ready, sprefix, replies = KEYS[1], KEYS[2], KEYS[3]
local token, sid, seq, msg_id, entry_id, id = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4],
  ARGV[5], ARGV[6]
local n, payload, timeout = tonumber(ARGV[7]), ARGV[8], tonumber(ARGV[9])
local maxlen, ttl = tonumber(ARGV[10]), tonumber(ARGV[12])
local attempt, pos = tonumber(ARGV[14]), tonumber(ARGV[15])
local pmaxlen, pttl = tonumber(ARGV[16]), tonumber(ARGV[17])
if #ARGV ~= 17 or not (seq and n and timeout and maxlen and ttl) or seq < 1 or n < 1
    or not (attempt and pos and pmaxlen and pttl) or attempt < 0 or pos < 0 or pmaxlen < 1
    or pttl < 1 or attempt ~= math.floor(attempt) or pos ~= math.floor(pos)
    or n ~= math.floor(n) or timeout < 0 or maxlen < 0 or ttl < 1
    or #sid == 0 or #sid > 256 or #msg_id == 0 or #msg_id > 256 or #id == 0 or #id > 1024
    or #payload == 0 then
  return redis.error_reply('ERR interrupt: bad arguments')
end
local extras = {}
if ARGV[11] ~= '' then
  local ok, list = pcall(cjson.decode, ARGV[11])
  if not ok or type(list) ~= 'table' or #list % 2 ~= 0 or #list > 64 then
    return redis.error_reply('ERR interrupt: bad reply extras')
  end
  for _, v in ipairs(list) do
    if type(v) ~= 'string' or v == 'interrupt_id' or v == 'payload' then
      return redis.error_reply('ERR interrupt: bad reply extras')
    end
  end
  extras = list
end
local state, lock = session_key(sprefix, sid, 'state'), session_key(sprefix, sid, 'lock')
local journal, await = journal_key(sprefix, sid, msg_id), await_key(sprefix, sid)
local err = expect_streams({replies}) or expect_types({{ready, 'zset'}, {ages_key(ready), 'zset'},
  {timers_key(ready), 'zset'}, {state, 'hash'}, {journal, 'hash'}, {await, 'string'}})
if err then return err end

if redis.pcall('GET', lock) ~= token then return {-1} end
local h = rcall('HMGET', state, 'a', 'w', 'T')
if (tonumber(h[1]) or 0) ~= seq - 1 or (h[2] and h[2] ~= msg_id) then return {-2} end

local now = now_ms()
local timeout_at = 0
if timeout > 0 then timeout_at = now + math.floor(timeout) end
rcall('HSET', state, 'w', msg_id)
busy_leave(ready, sid, h[3])  -- no longer in flight for its tenant (as a release)
rcall('HDEL', state, 'T')
rcall('SET', await, cjson.encode({
  id = id, n = n, msg_id = msg_id, seq = seq, entry_id = entry_id, payload = payload,
  at = now, timeout_at = timeout_at}))
rcall('HINCRBY', journal, 'w', 1)
if timeout_at > 0 then
  rcall('EXPIRE', journal, ttl + math.ceil(timeout / 1000))
  rcall('ZADD', timers_key(ready), timeout_at, sid .. '\n' .. AWAIT_TIMER)
else
  rcall('PERSIST', journal)
end
local event = {'interrupt_id', id, 'payload', payload}
for _, v in ipairs(extras) do event[#event + 1] = v end
reply_event(replies, maxlen, sid, msg_id, seq, 'awaiting', '', now, entry_id, event)
local partial = session_key(sprefix, sid, 'partial:' .. msg_id)
local added = redis.pcall('XADD', partial, 'MAXLEN', '~', pmaxlen,
  string.format('%d-%d', attempt + 1, pos), 'a', attempt, 'p', pos, 's', seq, 'k', 'v',
  't', ARGV[13], 'n', 'awaiting')
if type(added) ~= 'table' then rcall('EXPIRE', partial, pttl) end
rcall('DEL', lock)
rcall('ZREM', ready, sid)
rcall('ZREM', ages_key(ready), sid)
return {10, timeout_at}
