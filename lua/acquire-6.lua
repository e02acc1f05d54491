--[[
  acquire: take the session lock for one inbound entry and load the state, or park the entry.
  Take-or-park is one step so that an entry can never park just after the holder released the
  lock (it would then sit out its whole backoff with nobody to hand it on).

  KEYS[1] session lock (string: holder token, PX lease)
  KEYS[2] session state hash (d = state JSON, v = version, a = applied_seq, ia_* = attempt
          accounting of the message in flight; only seq applied+1 can ever be in flight)
  KEYS[3] session parked index (hash: seq -> delayed id)
  KEYS[4] delayed set (zset: delayed id -> due ms)
  KEYS[5] delayed data (hash: delayed id -> JSON array of the entry's field/value pairs)
  KEYS[6] inbound stream

  ARGV[1] token   ARGV[2] lock ttl (ms)   ARGV[3] group   ARGV[4] entry id   ARGV[5] seq
  ARGV[6] park delay (ms): backoff for this entry if it has to wait   ARGV[7] state ttl (s)

  Returns {code, attempts, version, applied_seq, state JSON, first_failed_at, last_error,
           handoff id, handoff fields JSON}
    code 1 ACQUIRED     the lock is ours and the entry is next: process it
    code 2 HANDOFF      the entry was parked, but the lock is ours and the parked successor
                        of applied_seq was taken instead: process the handed-off message
    code 3 DUPLICATE    seq <= applied_seq: acked and deleted, no second reply
    code 4 CONTENDED    another holder has the lock: parked with its backoff
    code 5 OUT_OF_ORDER a predecessor is not applied yet: parked with its backoff
]]
local rcall = redis.call
local lock, state, parked, delayed, data, stream = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local token, ttl, group, entry_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local seq = tonumber(ARGV[5])

local t = rcall('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function remove_entry()
  rcall('XACK', stream, group, entry_id)
  rcall('XDEL', stream, entry_id)
end

-- Move the entry from the stream to the delayed set (its durable home while it waits) and
-- index it under its seq so the predecessor's commit can hand it on at once.
local function park()
  local rows = rcall('XRANGE', stream, entry_id, entry_id)
  if #rows == 0 then
    rcall('XACK', stream, group, entry_id)
    return
  end
  local fields = rows[1][2]
  local counted = false
  for i = 1, #fields, 2 do
    if fields[i] == 'requeues' then
      fields[i + 1] = tostring((tonumber(fields[i + 1]) or 0) + 1)
      counted = true
      break
    end
  end
  if not counted then
    fields[#fields + 1] = 'requeues'
    fields[#fields + 1] = '1'
  end
  rcall('HSET', data, entry_id, cjson.encode(fields))
  rcall('ZADD', delayed, now + tonumber(ARGV[6]), entry_id)
  rcall('HSET', parked, seq, entry_id)
  remove_entry()
end

-- Count one more start of message `n`. A start that never reached commit or retry was lost
-- with its worker (crash, kill, lease lost): the counter survives it, so poison that kills
-- its worker is still dead-lettered after max attempts.
local function start_attempt(n)
  local f = rcall('HMGET', state, 'ia_seq', 'ia_n', 'ia_first', 'ia_err')
  local attempts, first, err = 1, '', ''
  if tonumber(f[1]) == n then
    attempts = (tonumber(f[2]) or 0) + 1
    first = f[3] or ''
    err = f[4] or ''
    if first == '' then
      first = tostring(now)
      rcall('HSET', state, 'ia_first', first)
    end
  else
    rcall('HDEL', state, 'ia_first', 'ia_err')
  end
  rcall('HSET', state, 'ia_seq', n, 'ia_n', attempts)
  rcall('EXPIRE', state, ARGV[7])
  return attempts, first, err
end

local st = rcall('HMGET', state, 'a', 'v', 'd')
local applied = tonumber(st[1]) or 0
local version = tonumber(st[2]) or 0
local doc = st[3] or ''

-- applied_seq only grows: a duplicate stays a duplicate whoever holds the lock.
if seq <= applied then
  remove_entry()
  return {3, 0, version, applied, '', '', '', '', ''}
end

local holder = rcall('GET', lock)
if holder and holder ~= token then
  park()
  return {4, 0, version, applied, '', '', '', '', ''}
end

rcall('SET', lock, token, 'PX', ttl)

if seq == applied + 1 then
  local attempts, first, err = start_attempt(seq)
  return {1, attempts, version, applied, doc, first, err, '', ''}
end

-- Out of order: park ourselves, and since we hold the lock, take the predecessor's successor
-- if it is parked (nobody else would hand it on: the lock was free).
park()
local next_id = rcall('HGET', parked, applied + 1)
if next_id then
  rcall('HDEL', parked, applied + 1)
  local payload = rcall('HGET', data, next_id)
  if payload then
    -- A lease, not a removal: if we die, the promoter returns it to the stream when it is due.
    rcall('ZADD', delayed, 'XX', now + tonumber(ttl), next_id)
    local attempts, first, err = start_attempt(applied + 1)
    return {2, attempts, version, applied, doc, first, err, next_id, payload}
  end
end
rcall('DEL', lock)
return {5, 0, version, applied, '', '', '', '', ''}
