--[[
  journal: record the result of one once() call of a running step (dialog_worker.once), so a
  later attempt of the same message gets it instead of calling again. Fenced twice: the lock
  must still be the caller's token AND the session's applied seq must be the message's seq - 1
  (a hand-off keeps the token for the next message): a stale attempt (paused past its lease,
  partitioned, or whose message was committed meanwhile) writes nothing. Bounded: the results
  of one message (names and values, in bytes) may not pass ARGV[7]; a result that would is
  refused and nothing is written. The first result recorded for a name stays: recording the
  same name again answers the one recorded (the caller returns that, not its own).

  The journal (a hash of the session, journal:<msg_id>: see _common.lua) is deleted by the
  message's commit, by reset and delete; its expiry (ARGV[8], set at every write) is a safety
  net only.

  KEYS[1] session key prefix ("<prefix>:{<tag>}:s:")

  ARGV[1] lock token   ARGV[2] session_id   ARGV[3] seq   ARGV[4] msg_id
  ARGV[5] name (1..128 bytes, no control characters)   ARGV[6] result (JSON text)
  ARGV[7] most bytes per message (DIALOG_JOURNAL_MAX_BYTES)   ARGV[8] expiry (s)

  Returns
    {8 JOURNALED, bytes used}      written
    {9 JOURNAL_HAD, result}        the name has a result already: nothing written
    {-1 FENCED_TOKEN}              the lock is not the caller's: nothing written
    {-2 FENCED_VERSION}            the message is not the session's next one: nothing written
    {-5 JOURNAL_FULL, bytes used}  it would pass the limit: nothing written
]]
local sprefix = KEYS[1]
local token, sid, seq, msg_id, name, value = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4],
  ARGV[5], ARGV[6]
local max_bytes, ttl = tonumber(ARGV[7]), tonumber(ARGV[8])
if #ARGV ~= 8 or not (seq and max_bytes and ttl) or seq < 1 or max_bytes < 1 or ttl < 1
    or #sid == 0 or #sid > 256 or #msg_id == 0 or #msg_id > 256 or #name == 0 or #name > 128
    or string.find(name, '%c') or #value == 0 then
  return redis.error_reply('ERR journal: bad arguments')
end
local state, lock = session_key(sprefix, sid, 'state'), session_key(sprefix, sid, 'lock')
local journal = journal_key(sprefix, sid, msg_id)
local err = expect_types({{state, 'hash'}, {journal, 'hash'}})
if err then return err end

if redis.pcall('GET', lock) ~= token then return {-1} end
if (tonumber(rcall('HGET', state, 'a')) or 0) ~= seq - 1 then return {-2} end

local had = rcall('HGET', journal, 'o:' .. name)
if had then return {9, had} end
local used = tonumber(rcall('HGET', journal, 'b')) or 0
local total = used + #name + #value
if total > max_bytes then return {-5, used} end
rcall('HSET', journal, 'o:' .. name, value, 'b', total)
rcall('EXPIRE', journal, ttl)
return {8, total}
