--[[
  emit: append one batch of a streamed reply's partial text to the message's partial stream,
  only while the caller holds the session's lock (a worker that lost its lease writes
  nothing), or append the stream's end entry once the message's commit has been written.

  Every entry carries the attempt that wrote it and its position in that attempt's answer
  (0, 1, 2...): readers resume from (attempt, pos), never from a Redis entry id. The stream is
  capped (MAXLEN ~) and expires a fixed time after its last append.

  Safe to send twice: a batch whose position the stream already has for that attempt is not
  written again, nothing is appended after an end entry, and a batch of an attempt older than
  the stream's newest one is refused.

  KEYS[1] session lock   KEYS[2] the message's partial stream

  ARGV[1] kind: "d" (a batch of text; fenced by the lock) or "e" (the end; not fenced: only
          a worker whose commit succeeded sends it)
  ARGV[2] lock token ("d" only)   ARGV[3] attempt   ARGV[4] pos   ARGV[5] seq
  ARGV[6] text (the batch, or the committed reply)
  ARGV[7] whole text so far ("" for none: a snapshot for readers that fell behind a trim)
  ARGV[8] outcome ("e" only)   ARGV[9] MAXLEN   ARGV[10] ttl (s)

  Returns 1 appended, 0 already there (nothing written), -1 FENCED_TOKEN (the lock is not the
  caller's), -3 STALE (the stream already holds a newer attempt).
]]
local lock, partial = KEYS[1], KEYS[2]
local kind, token = ARGV[1], ARGV[2]
local attempt, pos, seq = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local text, full, outcome = ARGV[6], ARGV[7], ARGV[8]
local maxlen, ttl = tonumber(ARGV[9]), tonumber(ARGV[10])
if #ARGV ~= 10 or (kind ~= 'd' and kind ~= 'e') or not (attempt and pos and seq and maxlen and ttl)
    or attempt < 0 or pos < 0 or seq < 0 or maxlen < 1 or ttl < 1 then
  return redis.error_reply('ERR emit: bad arguments')
end
local err = expect_type(partial, 'stream')
if err then return err end

if kind == 'd' and redis.pcall('GET', lock) ~= token then
  return -1
end

-- The newest entry says where the stream stands (MAXLEN trims the oldest, never it).
local last = rcall('XREVRANGE', partial, '+', '-', 'COUNT', 1)[1]
if last then
  local f, la, lp, lk = last[2], nil, nil, nil
  for i = 1, #f - 1, 2 do
    if f[i] == 'a' then la = tonumber(f[i + 1])
    elseif f[i] == 'p' then lp = tonumber(f[i + 1])
    elseif f[i] == 'k' then lk = f[i + 1] end
  end
  if lk == 'e' then return 0 end
  if kind == 'd' and la and lp then
    if attempt < la then return -3 end
    if attempt == la and pos <= lp then return 0 end
  end
end

local fields = {'a', attempt, 'p', pos, 's', seq, 'k', kind, 't', text}
if full ~= '' then
  fields[#fields + 1] = 'f'
  fields[#fields + 1] = full
end
if kind == 'e' then
  fields[#fields + 1] = 'o'
  fields[#fields + 1] = outcome
end
rcall('XADD', partial, 'MAXLEN', '~', maxlen, '*', unpack(fields))
rcall('EXPIRE', partial, ttl)
return 1
