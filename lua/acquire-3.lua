--[[
  acquire: one model call's turn on a limit key (a provider's quota, e.g. openai:gpt-4.1),
  shared by every worker and shard of the deployment. One call of this script per model call
  that goes through a limited key; none for a key with no limit (the worker caches that).

  Rates are GCRA on Redis time, without burst: the key's theoretical arrival times for
  requests (tr, one request every 60000/rpm ms) and tokens (tt, the estimate's tokens at
  60000/tpm ms each) say when the next call may go. A call is given the later of the two (and
  of the end of a pause) and charged at once, so every call has its own time and no two
  callers are told the same one:
    - a time at most max wait away: GRANTED; the caller waits that long inside its step, and
      holds an in-flight slot (a lease: a crashed caller's slot comes back when it ends);
    - further away: RESERVED; the turn is kept for this call id, and the caller hands its
      message back until then (no attempt spent). When it comes back with the same call id
      it is GRANTED that turn without being charged again, so waiting sessions resume in the
      order they were refused, one turn apart, not all at once.
  A pause (lua/pause-1.lua, after a provider's 429) closes the key until paused_until: a
  reservation that fell inside the pause is dropped and its caller queued again after it; a
  key with no rates reopens one caller every REOPEN_SPACING_MS (nf). max_in_flight full:
  BUSY, nothing charged. A call sent twice (its reply lost) is charged twice: the safe side.

  KEYS[1] limit hash   KEYS[2] in-flight set (call id -> lease end, ms)
  KEYS[3] reserved set (call id -> its turn, ms; the hash keeps r:<call id> = '<turn>:<tokens>')

  ARGV[1] call id   ARGV[2] estimated tokens
  ARGV[3] rpm   ARGV[4] tpm   ARGV[5] max in flight   (the settings' values, 0: none; the hash's
          rpm / tpm / mif fields, set at runtime, win)
  ARGV[6] in-flight lease (ms)   ARGV[7] max wait (ms)

  Returns {code, wait ms, why, tokens charged}: code 1 GRANTED (go after wait), 2 RESERVED
  (come back after wait), 3 BUSY (max_in_flight reached: try again after wait); why is 'rpm',
  'tpm', 'paused', 'in_flight', 'reserved' (a turn kept earlier) or '' (no wait).
  Hash fields: rpm tpm mif (runtime limits), tr tt (arrival times), pu pr (paused until,
  why), nf (next reopening turn), mb mc mt pc pt (this and the previous minute's calls and
  tokens: the current rate, for operators).
]]
local conf, in_flight, reserved = KEYS[1], KEYS[2], KEYS[3]
local id, estimate = ARGV[1], tonumber(ARGV[2])
local lease, max_wait = tonumber(ARGV[6]), tonumber(ARGV[7])
local defaults = {rpm = tonumber(ARGV[3]), tpm = tonumber(ARGV[4]), mif = tonumber(ARGV[5])}
if id == '' or #id > 1024 or not (estimate and lease and max_wait and defaults.rpm
    and defaults.tpm and defaults.mif) or estimate < 0 or estimate > 1e12
    or math.floor(estimate) ~= estimate or lease < 1 or max_wait < 0 then
  return redis.error_reply('ERR acquire: bad arguments')
end
local err = expect_types({{conf, 'hash'}, {in_flight, 'zset'}, {reserved, 'zset'}})
if err then return err end

local BUSY_WAIT_MS = 100
local REOPEN_SPACING_MS = 50
-- An unused reservation lapses this long after its turn (its caller never came back).
local RESERVATION_GRACE_MS = 600000
local PURGE = 100

local now = now_ms()
local h = rcall('HMGET', conf, 'rpm', 'tpm', 'mif', 'tr', 'tt', 'pu', 'nf', 'mb', 'r:' .. id)
local function limit(value, default)
  local n = tonumber(value)
  if n == nil or n < 0 then return default end
  return n
end
local rpm, tpm, mif = limit(h[1], defaults.rpm), limit(h[2], defaults.tpm),
  limit(h[3], defaults.mif)
local tr, tt, pu, nf = tonumber(h[4]) or 0, tonumber(h[5]) or 0, tonumber(h[6]) or 0,
  tonumber(h[7]) or 0
local paused = pu > now

-- The current rate, per wall-clock minute (cheap: a few fields).
local function count(tokens)
  local minute = math.floor(now / 60000)
  local mb = tonumber(h[8])
  if mb ~= minute then
    local last = {0, 0}
    if mb == minute - 1 then last = rcall('HMGET', conf, 'mc', 'mt') end
    rcall('HSET', conf, 'mb', minute, 'mc', 0, 'mt', 0, 'pc', last[1] or 0, 'pt', last[2] or 0)
  end
  rcall('HINCRBY', conf, 'mc', 1)
  rcall('HINCRBY', conf, 'mt', tokens)
end

local function grant(wait, why, tokens)
  rcall('ZADD', in_flight, now + wait + lease, id)
  count(tokens)
  return {1, wait, why, tokens}
end

local function forget(old)
  rcall('ZREM', reserved, old)
  rcall('HDEL', conf, 'r:' .. old)
end

-- Slots of crashed callers come back; reservations nobody came back for lapse.
rcall('ZREMRANGEBYSCORE', in_flight, '-inf', now)
for _, old in ipairs(rcall('ZRANGEBYSCORE', reserved, '-inf', now - RESERVATION_GRACE_MS,
                           'LIMIT', 0, PURGE)) do
  forget(old)
end

local full = mif > 0 and rcall('ZCARD', in_flight) >= mif
-- A turn kept for this call id: 'r:<id>' = '<turn ms>:<tokens>'.
local turn, kept = nil, nil
if h[9] then
  local t, n = string.match(h[9], '^([%d.]+):(%d+)$')
  turn, kept = tonumber(t), tonumber(n)
  if not (turn and kept) or (paused and turn < pu) or turn <= now - RESERVATION_GRACE_MS then
    forget(id)  -- unreadable, lapsed, or the pause came after it was kept: queued again
    turn = nil
  end
end
if turn then
  local wait = math.max(0, turn - now)
  if wait > max_wait then return {2, wait, 'reserved', 0} end
  if full then return {3, BUSY_WAIT_MS, 'in_flight', 0} end
  forget(id)
  return grant(wait, 'reserved', kept)
end
if full then return {3, BUSY_WAIT_MS, 'in_flight', 0} end

local at, why = now, ''
if paused then at, why = pu, 'paused' end
if rpm > 0 and tr > at then at, why = tr, 'rpm' end
if tpm > 0 and tt > at then at, why = tt, 'tpm' end
if rpm == 0 and tpm == 0 and paused then
  -- No rate to space the reopening: one caller every REOPEN_SPACING_MS, in order.
  if nf > at then at = nf end
  rcall('HSET', conf, 'nf', at + REOPEN_SPACING_MS)
end
if rpm > 0 then rcall('HSET', conf, 'tr', at + 60000 / rpm) end
if tpm > 0 then rcall('HSET', conf, 'tt', at + estimate * 60000 / tpm) end
local wait = at - now
if wait <= max_wait then return grant(wait, why, estimate) end
rcall('ZADD', reserved, at, id)
rcall('HSET', conf, 'r:' .. id, string.format('%.3f', at) .. ':' .. estimate)
return {2, wait, why, estimate}
