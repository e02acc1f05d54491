--[[
  release: give a message we hold back to its session's queue: after a failed attempt (the
  error is recorded, the attempt stays counted) or at shutdown (a hand-back: the attempt is
  given back, unless the step had streamed partial text: those entries' ids carry the attempt
  number, so the next attempt needs a new one for readers to start over). The message stays
  where it is (the stream); the session comes back through the ready set after the delay.
  Nothing happens unless the lock is still ours for that seq.

  KEYS[1] ready set   KEYS[2] session key prefix

  ARGV[1] token   ARGV[2] session_id   ARGV[3] seq   ARGV[4] delay (ms)
  ARGV[5] error text (for a hand-back keeping the attempt: why, or "")
  ARGV[6] "1": a failed attempt | "0": a hand-back | "2": a hand-back keeping the attempt
          (worker/dialog_worker/store/scripts.py's Release; any other value is refused, nothing written)

  Returns 7 (RELEASED) or -1 (FENCED_TOKEN).
]]
local ready, sprefix = KEYS[1], KEYS[2]
local sid, seq, delay, mode = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[6]
if not (seq and delay and (mode == '0' or mode == '1' or mode == '2')) then
  return redis.error_reply('ERR release: bad arguments')
end
local err = expect_type(ready, 'zset')
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
elseif ARGV[5] ~= '' then
  rcall('HSET', state, 'e', ARGV[5])  -- why the attempt stays counted, for a later dead letter
end
rcall('DEL', lock)
rcall('ZADD', ready, now + delay, sid)
return 7
