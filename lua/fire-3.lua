--[[
  fire: append the due timers of one shard to its inbound stream and remove them, in one
  atomic step, so each timer becomes exactly one entry (a worker killed before or after the
  call leaves the timer either waiting or appended, never both, never neither). The entry is
  then sequenced by intake like any other message, in the order it was appended. Any worker
  may call this at any time; calls by several workers at once fire each timer once.

  A timer's entry carries the fields its payload holds (see set_timer in _common.lua):
  session_id, text, msg_id ("timer:<name>:<due ms>" for a timer set by a step; the
  producer's msg_id for a message sent with deliver_at), a field timer (its name), and its
  meta fields.

  A parked interrupt's timeout is a member of the same set (<session id>\n AWAIT_TIMER, see
  _common.lua) without a payload: when due, its session is put in the ready set, due now.

  KEYS[1] inbound stream   KEYS[2] ready set (the timers are <ready>:timers)
  KEYS[3] session key prefix

  ARGV[1] most timers to fire (1..1000)

  Returns {fired, ms until the next timer is due (-1: none)}
]]
local stream, ready, sprefix = KEYS[1], KEYS[2], KEYS[3]
local count = tonumber(ARGV[1])
if not count or count < 1 or count > 1000 then
  return redis.error_reply('ERR fire: bad arguments')
end
local zkey = timers_key(ready)
for _, check in ipairs({{stream, 'stream'}, {zkey, 'zset'}, {ready, 'zset'},
                        {ready .. ':kick', 'list'}}) do
  local err = expect_type(check[1], check[2])
  if err then return err end
end

local now = now_ms()
local fired = 0
for _, member in ipairs(rcall('ZRANGEBYSCORE', zkey, '-inf', now, 'LIMIT', 0, count)) do
  local cut = string.find(member, '\n', 1, true)
  local payload
  if cut and string.sub(member, cut + 1) == AWAIT_TIMER then
    -- A parked interrupt's timeout (interrupt-3.lua): its session is looked at now, and
    -- resume-3.lua ends the wait.
    rcall('ZADD', ready, now, string.sub(member, 1, cut - 1))
    kick(ready)
  elseif cut then
    payload = drop_timer(ready, sprefix, string.sub(member, 1, cut - 1), string.sub(member, cut + 1))
  end
  rcall('ZREM', zkey, member)  -- also a member whose payload is gone (removed by hand)
  local ok, _, _, fields = pcall(cmsgpack.unpack, payload or '')
  if ok and type(fields) == 'table' and #fields >= 2 and #fields <= 200 and #fields % 2 == 0 then
    rcall('XADD', stream, '*', unpack(fields))
    fired = fired + 1
  end
end

local first = rcall('ZRANGE', zkey, 0, 0, 'WITHSCORES')
local wait = -1
if first[2] then wait = math.max(0, tonumber(first[2]) - now) end
return {fired, wait}
