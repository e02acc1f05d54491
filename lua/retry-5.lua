--[[
  retry: a failed attempt (or a hand-back at shutdown). Moves the message we hold into the
  delayed set with its backoff and releases the lock, atomically, if the lock is still ours.
  The message is not indexed as parked: a later lock holder must not pull it forward past its
  backoff. If the lock is no longer ours nothing is done: the message is still pending where it
  was and comes back through reclaim or its lease.

  KEYS[1] session lock   KEYS[2] session state hash   KEYS[3] delayed set
  KEYS[4] delayed data   KEYS[5] inbound stream

  ARGV[1] token   ARGV[2] source ("s" stream entry | "d" delayed message)   ARGV[3] source id
  ARGV[4] group   ARGV[5] delay (ms)   ARGV[6] error text ("" for a hand-back)
  ARGV[7] "1": the attempt counts (record the error) | "0": hand-back, give the attempt back

  Returns 7 (REQUEUED) or -1 (FENCED_TOKEN).
]]
local rcall = redis.call
local lock, state, delayed, data, stream = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local source, id = ARGV[2], ARGV[3]

if rcall('GET', lock) ~= ARGV[1] then
  return -1
end

local t = rcall('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if ARGV[7] == '1' then
  rcall('HSETNX', state, 'ia_first', now)
  rcall('HSET', state, 'ia_err', ARGV[6])
else
  rcall('HINCRBY', state, 'ia_n', -1)
end

if source == 's' then
  local rows = rcall('XRANGE', stream, id, id)
  if #rows > 0 then
    rcall('HSET', data, id, cjson.encode(rows[1][2]))
    rcall('ZADD', delayed, now + tonumber(ARGV[5]), id)
  end
  rcall('XACK', stream, ARGV[4], id)
  rcall('XDEL', stream, id)
else
  rcall('ZADD', delayed, 'XX', now + tonumber(ARGV[5]), id)
end
rcall('DEL', lock)
return 7
