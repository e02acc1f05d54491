--[[
  hold: an operator holds a session, releases it, or redrives its dead letters into it.

  A held session (its state hash's h field: who or what held it, and when) takes no new
  work: intake sequences its messages but takes no lock, resume leaves it out of the ready
  set, and a commit hands nothing on (commit-5.lua; a dead letter holds the session by itself
  under DIALOG_ON_DEAD_LETTER=hold). A step already running finishes and commits.

    hold     set h (kept while the state hash lives; a state made by the hold expires as an
             idle one does)
    release  remove h; the session goes back to the ready set if anything waits
    redrive  (held sessions only) put the listed dead letters back in front of the waiting
             messages, in the order given: they take seqs applied + 1.., each waiting
             message moves up by their count (its q<seq> and u<seq> fields, and the seq its
             dedupe key records), the letters leave the dead-letter stream, and the session
             is released (and they leave the session's letters index). A letter already gone is counted, one whose msg_id was seen
             (redriven before) is removed and counted as a duplicate. Refused while the lock
             is held (a step is running: its commit would apply the wrong seq).
             An interrupting (coalescing) message that waits ends every message outstanding
             before it (xc, xs: seqs below it, ending_of in _common.lua); the letters were
             not outstanding when it came, so those fields do not move up over them: each
             waiting message they covered gets a cancel mark (SUPERSEDED_MARK for xs) kept a
             dedupe window, and the fields go.

  KEYS[1] ready set   KEYS[2] session key prefix   KEYS[3] dead-letter stream

  ARGV[1] hold | release | redrive   ARGV[2] session_id
  ARGV[3] hold: the note kept in h; redrive: dedupe ttl (s)
  ARGV[4] hold: the idle state's ttl (s), set when the session has no state yet (optional);
          redrive: number of letters N (1..200), then N groups of 3:
          dead-letter entry id, msg_id, fields (JSON array of names and values, strings)

  Returns
    {'held'} | {'released', waiting} | {'not_held'}
    {'redriven', inserted, gone, duplicates} | {'busy'}
]]
local ready, sprefix, dlq = KEYS[1], KEYS[2], KEYS[3]
local op, sid = ARGV[1], ARGV[2]
if (op ~= 'hold' and op ~= 'release' and op ~= 'redrive') or not sid or #sid == 0
    or #sid > 256 then
  return redis.error_reply('ERR hold: bad arguments')
end
for _, check in ipairs({{ready, 'zset'}, {dlq, 'stream'}, {ages_key(ready), 'zset'},
                        {session_key(sprefix, sid, 'state'), 'hash'}}) do
  local err = expect_type(check[1], check[2])
  if err then return err end
end
local state, lock = session_key(sprefix, sid, 'state'), session_key(sprefix, sid, 'lock')
local now = now_ms()

if op == 'hold' then
  -- A session with no state yet (held before its first message) gets the idle expiry an
  -- idle state has: nothing keeps an operator's hold of a session that never comes alive.
  local new = rcall('EXISTS', state) == 0
  rcall('HSET', state, 'h', ARGV[3] or '')
  local ttl = tonumber(ARGV[4])
  if new and ttl and ttl > 0 then rcall('EXPIRE', state, ttl) end
  return {'held'}
end

local h = rcall('HMGET', state, 'a', 's', 'h', 'xc', 'xs')
local applied, last = tonumber(h[1]) or 0, tonumber(h[2]) or 0
if not h[3] then return {'not_held'} end

if op == 'release' then
  rcall('HDEL', state, 'h')
  if last > applied then rcall('ZADD', ready, now, sid) end
  return {'released', last - applied}
end

-- redrive: validate every letter before the first write.
local ttl, n = tonumber(ARGV[3]), tonumber(ARGV[4])
if not (ttl and n) or ttl < 1 or n < 1 or n > 200 or #ARGV ~= 4 + 3 * n then
  return redis.error_reply('ERR hold: bad redrive arguments')
end
local letters = {}
for i = 0, n - 1 do
  local b = 4 + 3 * i
  local ok, fields = pcall(cjson.decode, ARGV[b + 3])
  if not ok or type(fields) ~= 'table' or #fields % 2 ~= 0 or #fields > 200 then
    return redis.error_reply('ERR hold: bad letter fields')
  end
  for _, v in ipairs(fields) do
    if type(v) ~= 'string' then return redis.error_reply('ERR hold: bad letter fields') end
  end
  if #ARGV[b + 2] == 0 or #ARGV[b + 2] > 256 then
    return redis.error_reply('ERR hold: bad msg_id')
  end
  letters[#letters + 1] = {id = ARGV[b + 1], msg_id = ARGV[b + 2], fields = fields}
end
if rcall('EXISTS', lock) == 1 then return {'busy'} end

local todo, gone, dups = {}, 0, 0
for _, l in ipairs(letters) do
  if #rcall('XRANGE', dlq, l.id, l.id) == 0 then
    gone = gone + 1
  elseif rcall('EXISTS', session_key(sprefix, sid, 'msg:' .. l.msg_id)) == 1 then
    dups = dups + 1
    rcall('XDEL', dlq, l.id)
    redis.pcall('ZREM', letters_key(sprefix, sid), l.id)
  else
    todo[#todo + 1] = l
  end
end
local k = #todo
if k > 0 then
  local xc, xs = tonumber(h[4]) or 0, tonumber(h[5]) or 0
  -- Move the waiting messages up by k, from the last down (a gap stays a gap).
  for seq = last, applied + 1, -1 do
    for _, role in ipairs({'q', 'u'}) do
      local value = rcall('HGET', state, role .. seq)
      if value then
        rcall('HSET', state, role .. (seq + k), value)
        rcall('HDEL', state, role .. seq)
      elseif role == 'q' then
        rcall('HDEL', state, role .. (seq + k))
      end
      if role == 'q' and value then
        local ok, id, fields = pcall(cmsgpack.unpack, value)
        if ok and type(id) == 'string' and type(fields) == 'table' then
          local mid = msg_id_of(id, fields)
          local dkey = session_key(sprefix, sid, 'msg:' .. mid)
          if redis.pcall('GET', dkey) == tostring(seq) then
            rcall('SET', dkey, seq + k, 'KEEPTTL')
          end
          if xc > seq or xs > seq then
            -- Ended by a waiting interrupt (coalesce): marked, as the fields no longer say.
            rcall('SET', cancel_key(sprefix, sid, mid), xc > seq and now or SUPERSEDED_MARK,
                  'EX', ttl)
            -- Found by delete (seq 1: no pruning here, which the operator's ACL does not
            -- allow; intake prunes).
            index_msg_id(sprefix, sid, mid, 1, now + ttl * 1000, ttl * 1000)
          end
        end
      end
    end
  end
  for i, l in ipairs(todo) do
    rcall('HSET', state, 'q' .. (applied + i), pack_message(l.id, l.fields))
    rcall('SET', session_key(sprefix, sid, 'msg:' .. l.msg_id), applied + i, 'EX', ttl)
    rcall('XDEL', dlq, l.id)
    redis.pcall('ZREM', letters_key(sprefix, sid), l.id)
  end
  rcall('HSET', state, 's', last + k, 'n', 0)
  rcall('HDEL', state, 'f', 'e', 'g', 'xc', 'xs')
  rcall('PERSIST', state)
  rcall('ZADD', ages_key(ready), entry_ms(todo[1].id), sid)
  last = last + k
end
rcall('HDEL', state, 'h')
if last > applied then rcall('ZADD', ready, now, sid) end
return {'redriven', k, gone, dups}
