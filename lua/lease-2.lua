--[[
  lease: the heartbeat of one worker on one shard. One call an interval renews the worker's
  lease, which covers every session it holds there (see the worker leases in _common.lua),
  and brings back the sessions of workers whose leases lapsed.

    lease alive         extend it
    lapsed, or none     a new worker number (a lapsed one is never renewed: the sessions
                        taken under it are brought back, and their holder must give up
                        their results); the lapsed number stays listed, so its sessions,
                        even ones locked by a call still on its way, are found
    lapsed leases       (any worker's, this one's too; the 128 that lapsed first) each gives
                        back up to ARGV[3] of its sessions (sweep_worker); one with none left
                        is forgotten TOMBSTONE_MS after it lapsed (a worker that stops marks
                        its lease lapsed long ago: it is forgotten at the next call)

  KEYS[1] ready set   KEYS[2] session key prefix
  ARGV[1] the worker's number on this shard (0: none yet)   ARGV[2] lease ttl (ms)
  ARGV[3] most sessions to bring back per lapsed lease (1..10000)

  Returns {number, lapsed (1: ARGV[1] was not alive, its sessions are lost), sessions brought
  back}
]]
local ready, sprefix = KEYS[1], KEYS[2]
local w, ttl, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if #ARGV ~= 3 or not (w and ttl and limit) or w < 0 or w ~= math.floor(w) or ttl < 1
    or limit < 1 or limit > 10000 then
  return redis.error_reply('ERR lease: bad arguments')
end
local err = expect_types({{ready, 'zset'}, {workers_key(ready), 'zset'}})
if err then return err end

-- Long enough for a call sent under a lapsed number before its worker learned of the lapse
-- to have run: its locks are swept too.
local TOMBSTONE_MS = 60000

local now = now_ms()
local wkey = workers_key(ready)
local lapsed = 0
if w > 0 and not lease_alive(ready, w, now) then
  lapsed = 1
  rcall('ZADD', wkey, 'LT', now - 1, w)  -- listed as lapsed (again, if it was forgotten)
end
if w == 0 or lapsed == 1 then
  w = rcall('INCR', wkey .. ':n')
end
rcall('ZADD', wkey, now + ttl, w)

local swept = 0
local dead = rcall('ZRANGEBYSCORE', wkey, '-inf', '(' .. now, 'WITHSCORES', 'LIMIT', 0, 128)
for i = 1, #dead, 2 do
  local n = sweep_worker(ready, sprefix, tonumber(dead[i]), now, limit)
  swept = swept + n
  if n == 0 and now - tonumber(dead[i + 1]) > TOMBSTONE_MS then
    rcall('ZREM', wkey, dead[i])
  end
end
if swept > 0 then kick(ready) end
return {w, lapsed, swept}
