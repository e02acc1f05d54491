--[[
  emit: append batches of streamed replies' partial text, each to its message's partial
  stream, only while the caller holds that session's lock (a worker that lost its lease writes
  nothing), or the end entry of a message whose commit has been written. One call carries the
  batches of every answer a worker is streaming (group flush): the cost is one call per flush
  interval per worker, not one per answer, and never one per token.

  Every entry carries the attempt that wrote it and its position in that attempt's answer
  (0, 1, 2...): readers resume from (attempt, pos), never from a Redis entry id. Each stream
  is capped (MAXLEN ~) and expires a fixed time after its last append.

  Safe to send twice: a batch whose position the stream already has for that attempt is not
  written again, nothing is appended after an end entry, and a batch of an attempt older than
  the stream's newest one is refused.

  KEYS: 2 per batch: the session's lock, the message's partial stream (so the name says 2)
  ARGV[1] MAXLEN   ARGV[2] ttl (s)   ARGV[3] number of batches N, then N groups of 8:
    kind ("d": text, fenced by the lock; "e": the end, not fenced: only a worker whose commit
    succeeded sends it; refused when the session's state is gone: deleted), lock token ("d" only), attempt, pos, seq,
    text (the batch, or the committed reply), whole text so far ("" for none: a snapshot for
    readers that fell behind a trim), outcome ("e" only)

  Returns one code per batch: 1 appended, 0 already there (nothing written), -1 FENCED_TOKEN
  (the lock is not the caller's), -3 STALE (the stream already holds a newer attempt), -4 BAD
  (the stream's key holds another type: that batch alone is refused).
]]
local maxlen, ttl, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local WIDTH = 8
if not (maxlen and ttl and n) or maxlen < 1 or ttl < 1 or n < 1 or #ARGV ~= 3 + n * WIDTH
    or #KEYS ~= 2 * n then
  return redis.error_reply('ERR emit: bad arguments')
end

-- Validate every batch, and the type of every stream, before any write.
local batches = {}
for i = 0, n - 1 do
  local b = 3 + i * WIDTH
  local e = {kind = ARGV[b + 1], token = ARGV[b + 2], attempt = tonumber(ARGV[b + 3]),
             pos = tonumber(ARGV[b + 4]), seq = tonumber(ARGV[b + 5]), text = ARGV[b + 6],
             full = ARGV[b + 7], outcome = ARGV[b + 8], lock = KEYS[2 * i + 1],
             partial = KEYS[2 * i + 2]}
  if (e.kind ~= 'd' and e.kind ~= 'e') or not (e.attempt and e.pos and e.seq)
      or e.attempt < 0 or e.pos < 0 or e.seq < 0 then
    return redis.error_reply('ERR emit: bad arguments for batch ' .. (i + 1))
  end
  -- A key of another type (written by hand) refuses its batch alone.
  e.bad = expect_type(e.partial, 'stream') ~= nil
  batches[#batches + 1] = e
end

local function append(e)
  if e.bad then return -4 end
  if e.kind == 'd' and redis.pcall('GET', e.lock) ~= e.token then
    return -1
  end
  -- An end after the session was deleted (DialogClient.delete ran between the commit and
  -- this call) would bring its partial stream back: no state hash, no end.
  if e.kind == 'e' and rcall('EXISTS', (string.gsub(e.lock, ':lock$', ':state'))) == 0 then
    return -1
  end
  -- The newest entry says where the stream stands (MAXLEN trims the oldest, never it).
  local last = rcall('XREVRANGE', e.partial, '+', '-', 'COUNT', 1)[1]
  if last then
    local f, la, lp, lk = last[2], nil, nil, nil
    for j = 1, #f - 1, 2 do
      if f[j] == 'a' then la = tonumber(f[j + 1])
      elseif f[j] == 'p' then lp = tonumber(f[j + 1])
      elseif f[j] == 'k' then lk = f[j + 1] end
    end
    if lk == 'e' then return 0 end
    if e.kind == 'd' and la and lp then
      if e.attempt < la then return -3 end
      if e.attempt == la and e.pos <= lp then return 0 end
    end
  end
  local fields = {'a', e.attempt, 'p', e.pos, 's', e.seq, 'k', e.kind, 't', e.text}
  if e.full ~= '' then
    fields[#fields + 1] = 'f'
    fields[#fields + 1] = e.full
  end
  if e.kind == 'e' then
    fields[#fields + 1] = 'o'
    fields[#fields + 1] = e.outcome
  end
  rcall('XADD', e.partial, 'MAXLEN', '~', maxlen, '*', unpack(fields))
  rcall('EXPIRE', e.partial, ttl)
  return 1
end

local results = {}
for _, e in ipairs(batches) do
  results[#results + 1] = append(e)
end
return results
