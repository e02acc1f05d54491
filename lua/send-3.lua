--[[
  send: assign the session's next seq and append the message to the inbound stream, atomically,
  deduplicating on msg_id inside the dedupe window.

  KEYS[1] session state hash (field "s" holds the last assigned seq; sharing the hash with
          the state means the counter and applied_seq expire together, never one without the other)
  KEYS[2] dedupe key of this msg_id (string: the seq it was given)
  KEYS[3] inbound stream

  ARGV[1] session_id   ARGV[2] msg_id   ARGV[3] text
  ARGV[4] dedupe ttl (s)   ARGV[5] state ttl (s)

  Returns {seq, duplicate (0|1), entry id or ""}.
]]
local rcall = redis.call

local seen = rcall('GET', KEYS[2])
if seen then
  return {tonumber(seen), 1, ''}
end

local t = rcall('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local seq = rcall('HINCRBY', KEYS[1], 's', 1)
rcall('EXPIRE', KEYS[1], ARGV[5])
rcall('SET', KEYS[2], seq, 'EX', ARGV[4])
local id = rcall('XADD', KEYS[3], '*',
  'session_id', ARGV[1], 'msg_id', ARGV[2], 'seq', seq, 'text', ARGV[3], 'enqueued_at', now_ms)
return {seq, 0, id}
