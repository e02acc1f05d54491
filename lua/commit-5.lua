--[[
  commit: the fenced writes of one or more finished messages (group commit: every commit that
  is ready when the previous call returns goes in one call), each independent of the others.
  Per commit: if the lock is still ours and the state is at the version we read, write the new
  state, append the reply event (and the dead letter, and a duplicate event for each copy of
  the message that arrived meanwhile), delete the entry (and the copies) from the stream, then
  hand the lock on to the session's next message if one is waiting (return it), or release it
  and start the idle TTL. A fenced commit writes nothing.

  Everything that can fail is checked before the first write: the arguments of every commit,
  and the types of the shared keys. Per-session keys are read with pcall, so a corrupt one
  fences that commit alone.

  KEYS[1] inbound stream   KEYS[2] ready set   KEYS[3] session key prefix
  KEYS[4] reply stream     KEYS[5] dead-letter stream

  ARGV[1] lock ttl (ms)   ARGV[2] state ttl (s)   ARGV[3] reply MAXLEN (0: none)
  ARGV[4] number of commits N, then N groups of 11:
    token, session_id, seq, expected version, state JSON, msg_id, reply, outcome
    ("applied" | "dead_lettered"), entry id (stream entry of the message; "" for a gap),
    dead-letter fields (JSON array of name/value pairs added after the original fields; ""
    for a normal commit), id of the session's next entry if the caller already has it (or "")

  A commit that already ran (same token and seq, recorded in the state's c field) is answered
  as it was the first time and writes nothing: a client that lost the reply may send it again.

  Returns one reply per commit:
    {6 COMMITTED, new version}                   written; lock released (or left to resume)
    {2 HANDOFF, new version, next seq, next id, fields}   written; the lock stays ours for
        the next message (fields {} when the caller said it already has that entry)
    {-1 FENCED_TOKEN}    the lock is not ours any more: nothing written
    {-2 FENCED_VERSION}  the state moved on since we read it: nothing written
]]
local stream, ready, sprefix, replies, dlq = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lock_ttl, state_ttl, maxlen, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4])
local WIDTH = 11
if not (lock_ttl and state_ttl and maxlen and n) or n < 1 or #ARGV ~= 4 + n * WIDTH then
  return redis.error_reply('ERR commit: bad arguments')
end
for _, check in ipairs({{stream, 'stream'}, {ready, 'zset'}, {replies, 'stream'}, {dlq, 'stream'}}) do
  local err = expect_type(check[1], check[2])
  if err then return err end
end

-- Validate every commit before any write.
local commits = {}
for i = 0, n - 1 do
  local b = 4 + i * WIDTH
  local c = {token = ARGV[b + 1], sid = ARGV[b + 2], seq = tonumber(ARGV[b + 3]),
             version = tonumber(ARGV[b + 4]), doc = ARGV[b + 5], msg_id = ARGV[b + 6],
             reply = ARGV[b + 7], outcome = ARGV[b + 8], entry_id = ARGV[b + 9],
             known_next = ARGV[b + 11]}
  if not (c.seq and c.version and c.seq >= 1) or
     (c.outcome ~= 'applied' and c.outcome ~= 'dead_lettered') then
    return redis.error_reply('ERR commit: bad arguments for commit ' .. (i + 1))
  end
  if ARGV[b + 10] ~= '' then
    local ok, extra = pcall(cjson.decode, ARGV[b + 10])
    if not ok or type(extra) ~= 'table' or #extra % 2 ~= 0 or #extra > 64 then
      return redis.error_reply('ERR commit: bad dead-letter fields for commit ' .. (i + 1))
    end
    for _, v in ipairs(extra) do
      if type(v) ~= 'string' then
        return redis.error_reply('ERR commit: bad dead-letter fields for commit ' .. (i + 1))
      end
    end
    c.extra = extra
  end
  commits[#commits + 1] = c
end

local now = now_ms()
local results, dels = {}, {}

for _, c in ipairs(commits) do
  local state, lock = session_key(sprefix, c.sid, 'state'), session_key(sprefix, c.sid, 'lock')
  local holder = redis.pcall('GET', lock)
  local h = redis.pcall('HMGET', state, 'v', 'a', 's', 'q' .. (c.seq + 1), 'u' .. c.seq, 'c')
  local done = type(h) == 'table' and not h['err'] and h[6] == c.token .. ':' .. c.seq
  if done and (tonumber(h[1]) or 0) == c.version + 1 then
    -- This very commit already ran (a client re-sent the call after losing the reply):
    -- answer as it did, writing nothing more.
    local next_id = h[4]
    if holder == c.token and next_id and (tonumber(h[3]) or 0) > c.seq then
      local rows = next_id ~= c.known_next and rcall('XRANGE', stream, next_id, next_id) or {}
      results[#results + 1] = {2, c.version + 1, c.seq + 1, next_id, rows[1] and rows[1][2] or {}}
    else
      results[#results + 1] = {6, c.version + 1}
    end
  elseif holder ~= c.token then
    results[#results + 1] = {-1}
  elseif type(h) ~= 'table' or h['err'] or (tonumber(h[1]) or 0) ~= c.version
      or (tonumber(h[2]) or 0) ~= c.seq - 1 then
    results[#results + 1] = {-2}
  else
    local version, last, next_id = c.version + 1, tonumber(h[3]) or 0, h[4]
    if c.extra then
      local rows = c.entry_id ~= '' and rcall('XRANGE', stream, c.entry_id, c.entry_id) or {}
      local letter = rows[1] and letter_fields(rows[1][2]) or {'session_id', c.sid}
      for _, v in ipairs(c.extra) do letter[#letter + 1] = v end
      for _, v in ipairs({'source_stream', stream, 'source_entry_id', c.entry_id}) do
        letter[#letter + 1] = v
      end
      rcall('XADD', dlq, '*', unpack(letter))
    end
    reply_event(replies, maxlen, c.sid, c.msg_id, c.seq, c.outcome, c.reply, now, c.entry_id)
    if c.entry_id ~= '' then dels[#dels + 1] = c.entry_id end
    if h[5] then
      -- Copies of this message that arrived while it was outstanding: answered now.
      for copy in string.gmatch(h[5], '[^,]+') do
        reply_event(replies, maxlen, c.sid, c.msg_id, c.seq, 'duplicate', c.reply, now, copy)
        dels[#dels + 1] = copy
      end
    end
    rcall('HDEL', state, 'q' .. c.seq, 'u' .. c.seq, 'f', 'e', 'g')

    local next_rows = nil
    if last > c.seq and next_id and next_id ~= c.known_next then
      next_rows = rcall('XRANGE', stream, next_id, next_id)
    end
    if last > c.seq and next_id and (next_id == c.known_next or #next_rows > 0) then
      -- Hand-off: the lock stays ours for the next message; its start is counted now.
      rcall('HSET', state, 'd', c.doc, 'v', version, 'a', c.seq, 'n', 1, 'c', c.token .. ':' .. c.seq)
      rcall('PEXPIRE', lock, lock_ttl)
      rcall('ZADD', ready, now + lock_ttl, c.sid)
      results[#results + 1] = {2, version, c.seq + 1, next_id,
                               next_rows and next_rows[1][2] or {}}
    else
      rcall('HSET', state, 'd', c.doc, 'v', version, 'a', c.seq, 'n', 0, 'c', c.token .. ':' .. c.seq)
      rcall('DEL', lock)
      if last > c.seq then
        rcall('ZADD', ready, now, c.sid)  -- the next entry is missing: resume decides (gap)
      else
        rcall('ZREM', ready, c.sid)
        rcall('EXPIRE', state, state_ttl)
      end
      results[#results + 1] = {6, version}
    end
  end
end

for i = 1, #dels, 1000 do
  rcall('XDEL', stream, unpack(dels, i, math.min(i + 999, #dels)))
end
return results
