--[[
  emit: append batches of streamed replies' partial text, each to its message's partial
  stream, only while the caller holds that session's lock (a worker that lost its lease writes
  nothing), or the end entry of a message whose commit has been written. One call carries the
  batches of every answer a worker is streaming (group flush): the cost is one call per flush
  interval per worker, not one per answer, and never one per token.

  Every entry carries the attempt that wrote it and its position in that attempt's answer
  (0, 1, 2...): readers resume from (attempt, pos), never from a Redis entry id. Each stream
  is capped (MAXLEN ~).

  Safe to send twice: a batch whose position the stream already has for that attempt is not
  written again, nothing is appended after an end entry, and a batch of an attempt older than
  the stream's newest one is refused. A stream whose newest entry has a lower seq belongs to
  an earlier message sent under the same msg_id (it ended unapplied, which frees the msg_id):
  the first refused batch of the new one deletes it and starts the stream again. Redis itself checks all three: entry ids are explicit,
  <attempt + 1>-<pos> for text and 18446744073709551615-0 for the end (above every text id),
  so such a batch has an id at or below the stream's newest and XADD refuses it. Only then is
  the newest entry read, to say which case it was. A stream written by an earlier version of
  this script (time-based ids: an answer in flight during a rolling upgrade) refuses every
  explicit id: when its newest entry says the batch is new, it is appended with '*' as then.
  Each batch costs a lock check and an XADD; the end adds a check of the session's state.

  Expiry: not reset at every append (one command per batch less). It is set to ttl when an
  entry creates the stream (a stream never exists without one), at the first entry of each
  attempt (pos 0), every 32nd position, at the end, and at any batch whose refresh is "1" (the
  worker asks when ttl / 8 has passed since its last refresh, worker/dialog_worker/daemon/partial_writer.py). So a stream
  expires at most ttl, and, while its writer refreshes, at least 7/8 of ttl, after its last
  append, whether its writer finished or died.

  KEYS: 2 per batch: the session's lock, the message's partial stream (so the name says 2)
  ARGV[1] MAXLEN   ARGV[2] ttl (s)   ARGV[3] number of batches N, then N groups of 9:
    kind ("d": text, fenced by the lock; "v": a typed event (dialog_worker.emit_event), fenced
    and placed as text is; "w": a transient event (the worker's `waiting`), fenced, at no
    position (see append); "e": the end, not fenced: only a worker whose commit
    succeeded sends it; refused when the session's state is gone: deleted), lock token ("d"
    and "v" only), attempt, pos, seq,
    text (the batch, the event's data as JSON, or the committed reply), whole text so far
    ("" for none: a snapshot for readers that fell behind a trim), outcome ("e") or the
    event's kind ("v", written as field n), refresh ("1": set the expiry)

  Returns one code per batch: 1 appended, 0 already there (nothing written), -1 FENCED_TOKEN
  (the lock is not the caller's), -3 STALE (the stream already holds a newer attempt), -4 BAD
  (the stream's key holds another type, or refuses the append: that batch alone is refused).
]]
local maxlen, ttl, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local WIDTH = 9
local END_ID = '18446744073709551615-0'
local EXPIRE_EVERY = 32
-- attempt and pos make the ids: whole numbers Lua holds exactly.
local MAX_NUMBER = 2 ^ 52
if not (maxlen and ttl and n) or maxlen < 1 or ttl < 1 or n < 1 or #ARGV ~= 3 + n * WIDTH
    or #KEYS ~= 2 * n then
  return redis.error_reply('ERR emit: bad arguments')
end

local function whole(x)
  return x and x >= 0 and x < MAX_NUMBER and x == math.floor(x)
end

-- Validate every batch before any write.
local batches = {}
for i = 0, n - 1 do
  local b = 3 + i * WIDTH
  local e = {kind = ARGV[b + 1], token = ARGV[b + 2], attempt = tonumber(ARGV[b + 3]),
             pos = tonumber(ARGV[b + 4]), seq = tonumber(ARGV[b + 5]),
             refresh = ARGV[b + 9] == '1', lock = KEYS[2 * i + 1], partial = KEYS[2 * i + 2]}
  if (e.kind ~= 'd' and e.kind ~= 'e' and e.kind ~= 'v' and e.kind ~= 'w')
      or not (whole(e.attempt) and whole(e.pos) and e.seq)
      or e.seq < 0 then
    return redis.error_reply('ERR emit: bad arguments for batch ' .. (i + 1))
  end
  e.fields = {'a', e.attempt, 'p', e.pos, 's', e.seq, 'k', e.kind, 't', ARGV[b + 6]}
  if ARGV[b + 7] ~= '' then
    e.fields[#e.fields + 1] = 'f'
    e.fields[#e.fields + 1] = ARGV[b + 7]
  end
  if e.kind == 'e' then
    e.fields[#e.fields + 1] = 'o'
    e.fields[#e.fields + 1] = ARGV[b + 8]
  elseif e.kind == 'v' or e.kind == 'w' then
    e.fields[#e.fields + 1] = 'n'  -- the event's kind
    e.fields[#e.fields + 1] = ARGV[b + 8]
  end
  batches[#batches + 1] = e
end

-- XADD that returns its error instead of raising it (or false: no stream, with NOMKSTREAM).
local function xadd(e, id, create)
  if create then
    return redis.pcall('XADD', e.partial, 'MAXLEN', '~', maxlen, id, unpack(e.fields))
  end
  return redis.pcall('XADD', e.partial, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, id,
                     unpack(e.fields))
end

-- XADD refused the batch's id (rare): the newest entry says why (MAXLEN trims the oldest,
-- never it).
local function refused(e)
  local last = rcall('XREVRANGE', e.partial, '+', '-', 'COUNT', 1)[1]
  if last then
    local f, la, lp, lk, ls = last[2], nil, nil, nil, nil
    for j = 1, #f - 1, 2 do
      if f[j] == 'a' then la = tonumber(f[j + 1])
      elseif f[j] == 'p' then lp = tonumber(f[j + 1])
      elseif f[j] == 'k' then lk = f[j + 1]
      elseif f[j] == 's' then ls = tonumber(f[j + 1]) end
    end
    if ls and e.seq > ls then
      -- The stream is an earlier message's under the same msg_id (it ended without being
      -- applied, which frees its msg_id, and was sent again): this message starts it anew.
      rcall('DEL', e.partial)
      local got = xadd(e, e.kind == 'e' and END_ID or string.format('%d-%d', e.attempt + 1, e.pos), true)
      if type(got) == 'table' and got.err then return -4 end
      rcall('EXPIRE', e.partial, ttl)
      return 1
    end
    if lk == 'e' then return 0 end
    if e.kind ~= 'e' and la and lp then
      if e.attempt < la then return -3 end
      if e.attempt == la and e.pos <= lp then return 0 end
    end
  end
  -- New to a stream of time-based ids (an earlier version wrote it): appended as then.
  local got = xadd(e, '*', true)
  if type(got) == 'table' and got.err then return -4 end
  rcall('EXPIRE', e.partial, ttl)
  return 1
end

local function append(e)
  if e.kind ~= 'e' and redis.pcall('GET', e.lock) ~= e.token then
    return -1
  end
  if e.kind == 'w' then
    -- A transient event (a `waiting`) takes no position: its id is the previous attempt's
    -- next one (<attempt>-*), below every id of this attempt's answer, so the next attempt
    -- may keep its number. Once this attempt wrote (or on a stream of time-based ids), the
    -- id is refused and the event is not written (0).
    local got = xadd(e, string.format('%d-*', e.attempt), false)
    if got == false then got = xadd(e, string.format('%d-*', e.attempt), true) end
    if type(got) == 'table' and got.err then return 0 end
    rcall('EXPIRE', e.partial, ttl)
    return 1
  end
  -- An end after the session was deleted (DialogClient.delete ran between the commit and
  -- this call) would bring its partial stream back: no state hash, no end.
  if e.kind == 'e' and rcall('EXISTS', (string.gsub(e.lock, ':lock$', ':state'))) == 0 then
    return -1
  end
  local id = END_ID
  if e.kind ~= 'e' then id = string.format('%d-%d', e.attempt + 1, e.pos) end
  local expire = e.kind == 'e' or e.refresh or e.pos % EXPIRE_EVERY == 0
  local got = xadd(e, id, expire)
  if got == false then  -- no stream (expired, deleted): this entry creates it, with its expiry
    got, expire = xadd(e, id, true), true
  end
  if type(got) == 'table' and got.err then
    -- A key of another type (written by hand) refuses its batch alone.
    if string.sub(got.err, 1, 9) == 'WRONGTYPE' then return -4 end
    return refused(e)
  end
  if expire then rcall('EXPIRE', e.partial, ttl) end
  return 1
end

local results = {}
for _, e in ipairs(batches) do
  results[#results + 1] = append(e)
end
return results
