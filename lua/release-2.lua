--[[
  release: give a message we hold back to its session's queue: after a failed attempt (the
  error is recorded, the attempt stays counted) or at shutdown (a hand-back: the attempt is
  given back, unless the step had streamed partial text: those entries' ids carry the attempt
  number, so the next attempt needs a new one for readers to start over). A hand-back for the
  model's limit key (a provider's 429, a turn further away) after the step streamed keeps the
  attempt's number for the same reason, yet spends no attempt: the message's journal counts it
  (r, read beside w: attempts that are not counted against DIALOG_MAX_ATTEMPTS; the commit
  deletes the journal with the message). The message stays where it is (the stream); the
  session comes back through the ready set after the delay. Nothing happens unless the lock
  is still ours for that seq.

  KEYS[1] ready set   KEYS[2] session key prefix

  ARGV[1] token   ARGV[2] session_id   ARGV[3] seq   ARGV[4] delay (ms)
  ARGV[5] error text (for a hand-back: why, or "")
  ARGV[6] "1": a failed attempt | "0": a hand-back | "2": a hand-back keeping the attempt
          | "3": a hand-back keeping the attempt's number, not spending it
          (worker/dialog_worker/store/scripts.py's Release; any other value is refused, nothing written)
  ARGV[7] msg_id, ARGV[8] the journal's expiry (s): "3" only

  Returns 7 (RELEASED) or -1 (FENCED_TOKEN).
]]
local ready, sprefix = KEYS[1], KEYS[2]
local sid, seq, delay, mode = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[6]
if not (seq and delay and (mode == '0' or mode == '1' or mode == '2' or mode == '3')) then
  return redis.error_reply('ERR release: bad arguments')
end
local journal, journal_ttl = nil, tonumber(ARGV[8])
if mode == '3' then
  if not ARGV[7] or ARGV[7] == '' or not journal_ttl or journal_ttl < 1 then
    return redis.error_reply('ERR release: bad arguments')
  end
  journal = journal_key(sprefix, sid, ARGV[7])
end
local err = expect_type(ready, 'zset') or (journal and expect_type(journal, 'hash'))
if err then return err end

local state, lock = session_key(sprefix, sid, 'state'), session_key(sprefix, sid, 'lock')
if redis.pcall('GET', lock) ~= ARGV[1] then
  return -1
end
local applied = redis.pcall('HGET', state, 'a')
if type(applied) == 'table' or (tonumber(applied) or 0) ~= seq - 1 then
  return -1
end
local now = now_ms()
busy_leave(ready, sid, redis.pcall('HGET', state, 'T'))  -- no longer in flight (tenants)
rcall('HDEL', state, 'T')
if mode == '1' then
  rcall('HSETNX', state, 'f', now)
  rcall('HSET', state, 'e', ARGV[5])
elseif mode == '0' then
  rcall('HINCRBY', state, 'n', -1)
  -- Why it went back, when given (a wait for the model's key): the next attempt knows it
  -- waited (the console's record of its life); the commit clears it.
  if ARGV[5] ~= '' then rcall('HSET', state, 'e', ARGV[5]) end
elseif ARGV[5] ~= '' then
  rcall('HSET', state, 'e', ARGV[5])  -- why the attempt stays counted, for a later dead letter
end
if mode == '3' then
  rcall('HINCRBY', journal, 'r', 1)  -- not spent: the next attempt has a new number all the same
  rcall('EXPIRE', journal, journal_ttl)  -- a safety net: the message's commit deletes it
end
rcall('DEL', lock)
rcall('ZADD', ready, now + delay, sid)
-- A resumer whose ready set held only sessions under live worker leases waits on the kick
-- list (worker/dialog_worker/daemon/upkeep.py): it looks again now, and waits for the delay.
kick(ready)
return 7
