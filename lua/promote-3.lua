--[[
  promote: move delayed messages that are due back onto the inbound stream. Each move is
  atomic (remove from the delayed set, XADD), so any number of replicas may run it at once
  and a message is never in both places or in neither. A stale entry in a session's parked
  index is harmless: whoever reads it finds no data and drops it.

  KEYS[1] delayed set   KEYS[2] delayed data   KEYS[3] inbound stream
  ARGV[1] most messages to move in one call

  Returns {moved, ms until the next due message (-1: none waiting)}.
]]
local rcall = redis.call
local delayed, data, stream = KEYS[1], KEYS[2], KEYS[3]

local t = rcall('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local due = rcall('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, id in ipairs(due) do
  local payload = rcall('HGET', data, id)
  rcall('ZREM', delayed, id)
  rcall('HDEL', data, id)
  if payload then
    rcall('XADD', stream, '*', unpack(cjson.decode(payload)))
  end
end

local head = rcall('ZRANGE', delayed, 0, 0, 'WITHSCORES')
local wait = -1
if #head > 0 then
  wait = math.max(0, tonumber(head[2]) - now)
end
return {#due, wait}
