--[[
  commit: the fenced write of one applied (or dead-lettered) message, and the hand-off.
  Checks that the lock is still ours and the state version is the one we read; only then
  writes the state with its TTL, appends the reply (and the dead letter), removes the message
  from wherever it lived, and either hands the lock on to the parked successor or releases it.
  If the fence fails nothing is written and nothing is acked: the message is still pending and
  will be delivered again (and then found to be a duplicate if someone else applied it).

  KEYS[1] session lock   KEYS[2] session state hash   KEYS[3] session parked index
  KEYS[4] delayed set    KEYS[5] delayed data         KEYS[6] inbound stream
  KEYS[7] reply stream   KEYS[8] dead-letter stream

  ARGV[1] token   ARGV[2] expected version   ARGV[3] seq   ARGV[4] new state JSON
  ARGV[5] state ttl (s)   ARGV[6] source: "s" stream entry, "d" delayed (handed-off) message
  ARGV[7] source id   ARGV[8] group   ARGV[9] session_id   ARGV[10] msg_id   ARGV[11] reply
  ARGV[12] lock ttl (ms)   ARGV[13] reply stream MAXLEN (~, 0 = no trim)
  ARGV[14] dead-letter fields as a JSON array of name/value pairs, or "" for a normal commit
  ARGV[15] (optional) id of a stream entry this worker already holds whose seq is seq+1
           (the next message of the session, read in the same batch), or ""

  Returns {code, attempts, version, applied_seq, "", first_failed_at, last_error,
           handoff id, handoff fields JSON}
    code 6  COMMITTED       written, lock released
    code 2  HANDOFF         written; the lock is extended and the parked seq+1 is returned
    code 1  ACQUIRED        written; no parked seq+1, but the caller's own next entry
                            (ARGV[15]) is seq+1: the lock is extended for it, its start counted
    code -1 FENCED_TOKEN    the lock is not ours any more: nothing written
    code -2 FENCED_VERSION  the state moved on since we read it: nothing written
]]
local rcall = redis.call
local lock, state, parked, delayed, data = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local stream, replies, dlq = KEYS[6], KEYS[7], KEYS[8]
local token, seq = ARGV[1], tonumber(ARGV[3])

if rcall('GET', lock) ~= token then
  return {-1, 0, 0, 0, '', '', '', '', ''}
end
local version = tonumber(rcall('HGET', state, 'v')) or 0
if version ~= tonumber(ARGV[2]) then
  return {-2, 0, version, 0, '', '', '', '', ''}
end

local t = rcall('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

version = version + 1
rcall('HSET', state, 'd', ARGV[4], 'v', version, 'a', seq)
rcall('HDEL', state, 'ia_seq', 'ia_n', 'ia_first', 'ia_err')
rcall('EXPIRE', state, ARGV[5])

local reply = {'session_id', ARGV[9], 'msg_id', ARGV[10], 'seq', seq, 'reply', ARGV[11],
               'produced_at', now}
if tonumber(ARGV[13]) > 0 then
  rcall('XADD', replies, 'MAXLEN', '~', ARGV[13], '*', unpack(reply))
else
  rcall('XADD', replies, '*', unpack(reply))
end
if ARGV[14] ~= '' then
  rcall('XADD', dlq, '*', unpack(cjson.decode(ARGV[14])))
end

if ARGV[6] == 's' then
  rcall('XACK', stream, ARGV[8], ARGV[7])
  rcall('XDEL', stream, ARGV[7])
else
  rcall('ZREM', delayed, ARGV[7])
  rcall('HDEL', data, ARGV[7])
end
rcall('HDEL', parked, seq)

-- Hand-off: the successor may already be parked, waiting for exactly this commit.
local next_seq = seq + 1
local next_id = rcall('HGET', parked, next_seq)
if next_id then
  rcall('HDEL', parked, next_seq)
  local payload = rcall('HGET', data, next_id)
  if payload then
    rcall('PEXPIRE', lock, ARGV[12])
    -- A lease on the delayed entry: if we die now, the promoter returns it when it is due.
    rcall('ZADD', delayed, 'XX', now + tonumber(ARGV[12]), next_id)
    rcall('HSET', state, 'ia_seq', next_seq, 'ia_n', 1)
    return {2, 1, version, seq, '', '', '', next_id, payload}
  end
end
-- The caller's own next entry: it holds it already (same batch), so it goes on with the state
-- it has, and the entry's acquire round trip is saved. The entry stays in the caller's
-- pending list until its own commit; if the caller dies, reclaim delivers it as usual.
if ARGV[15] and ARGV[15] ~= '' then
  rcall('PEXPIRE', lock, ARGV[12])
  rcall('HSET', state, 'ia_seq', next_seq, 'ia_n', 1)
  return {1, 1, version, seq, '', '', '', '', ''}
end
rcall('DEL', lock)
return {6, 0, version, seq, '', '', '', '', ''}
