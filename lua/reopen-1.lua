--[[
  reopen: end a limit key's pause now, for every worker (`dialog-worker limits resume`, the
  console's Resume). The queue the pause built moves forward by what is left of it: the key's
  next turns (tr, tt, nf) and every turn kept for a waiting call (r:<call id>) that lay after
  now come that much sooner (never before now), so the waiting calls go in the order they were
  refused, one turn apart, from now instead of from the pause's end. The provider's run of
  429s (ps) is over: its next 429 pauses for the first floor (lua/pause-1.lua). The reserved
  set's scores are left as they were: they only say when an unclaimed turn lapses. The key's
  count of reopenings (ro) moves on: each worker that handed messages back for the pause sees
  it within a second and brings their sessions to their turn now (ModelGate.wake_resumed).

  Calls waiting in the tenants' queues at the key (acquire-3.lua, tenant-fair turns) hold no
  turn yet: they are handed turns in fair order from now on, as their callers come back.

  A key that is not paused is left as it is (nothing written): sent twice, the second call
  does nothing.

  KEYS[1] limit hash

  Returns the ms the pause was cut short by (0: the key was not paused).
]]
local conf = KEYS[1]
local err = expect_type(conf, 'hash')
if err then return err end

local now = now_ms()
local h = rcall('HMGET', conf, 'pu', 'tr', 'tt', 'nf')
local pu = tonumber(h[1]) or 0
if pu <= now then return 0 end
local early = pu - now

rcall('HDEL', conf, 'pu', 'pr', 'pa', 'ps')
rcall('HINCRBY', conf, 'ro', 1)  -- workers bring what they handed back for the pause now
local names = {'tr', 'tt', 'nf'}
for i, name in ipairs(names) do
  local at = tonumber(h[i + 1])
  if at and at > now then
    rcall('HSET', conf, name, string.format('%.3f', math.max(now, at - early)))
  end
end
-- The turns kept for calls that wait (acquire-3.lua: r:<call id> = '<turn ms>:<tokens>'),
-- as many as there are waiting calls.
local fields = rcall('HGETALL', conf)
for i = 1, #fields, 2 do
  local name = fields[i]
  if string.sub(name, 1, 2) == 'r:' then
    local t, n = string.match(fields[i + 1], '^([%d.]+):(%d+)$')
    local turn = tonumber(t)
    if turn and turn > now then
      rcall('HSET', conf, name, string.format('%.3f', math.max(now, turn - early)) .. ':' .. n)
    end
  end
end
return early
