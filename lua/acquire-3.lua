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

  Tenant-fair turns (a key with a rate): the key commits turns at most HORIZON ahead of now
  (FAIR_HORIZON_MS, or one request interval if that is longer). A call whose turn would be
  further away, or that finds calls already waiting, joins its tenant's queue at the key
  instead of taking the next turn in arrival order; each acquire hands the turns that come
  within the horizon to the waiting calls in the slots' weighted fair order (lua/_common.lua,
  "Tenants"): the tenant with the smallest virtual time first, which then moves on by
  1 / its weight from the key's virtual clock, and inside a tenant by priority, then arrival.
  A tenant alone takes every turn (work-conserving); a tenant that arrives behind another's
  backlog is given the next turn within the horizon. A queued call is answered RESERVED with
  an estimate of its turn (its place in the fair order times the interval) and comes back
  then: if a turn was handed to it meanwhile, it is its kept turn (r:<call id>, as above);
  if not, it is told again. A queued call whose caller did not come back within
  QUEUE_GRACE_MS of the time it was told is dropped when its turn comes (a crashed caller
  blocks nothing and holds no turn). Keys derived from KEYS[1] (its hash tag):
    <limit>:fair       zset  tenants with calls queued -> virtual time (the fair order)
    <limit>:vt         hash  tenant -> "<virtual time> <weight>"; field "\n": the virtual clock
    <limit>:q:<tenant> zset  the tenant's queued call ids -> place (arrival ms, moved
                             PRIORITY_STEP_MS per priority level)
    <limit>:calls      hash  queued call id -> "<tokens> <lease end ms>"
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
  ARGV[8] tenant   ARGV[9] its weight   ARGV[10] the message's priority (0-9)   (optional:
          'default', 1, 5)

  Returns {code, wait ms, why, tokens charged}: code 1 GRANTED (go after wait), 2 RESERVED
  (come back after wait: a kept turn, or a queued call's estimate, tokens 0), 3 BUSY
  (max_in_flight reached: try again after wait); why is 'rpm', 'tpm', 'paused', 'in_flight',
  'reserved' (a turn kept earlier) or '' (no wait).
  Hash fields: rpm tpm mif (runtime limits), tr tt (arrival times), pu pr (paused until,
  why), nf (next reopening turn), mb mc mt pc pt (this and the previous minute's calls and
  tokens: the current rate, for operators).
]]
local conf, in_flight, reserved = KEYS[1], KEYS[2], KEYS[3]
local id, estimate = ARGV[1], tonumber(ARGV[2])
local lease, max_wait = tonumber(ARGV[6]), tonumber(ARGV[7])
local defaults = {rpm = tonumber(ARGV[3]), tpm = tonumber(ARGV[4]), mif = tonumber(ARGV[5])}
local tenant, weight, prio = ARGV[8] or DEFAULT_TENANT, tonumber(ARGV[9] or '1'), ARGV[10] or '5'
if not tenant_ok(tenant) then tenant = DEFAULT_TENANT end
if not (weight and weight > 0 and weight <= 1e6) then weight = 1 end
prio = string.find(prio, '^%d$') and tonumber(prio) or 5
if id == '' or #id > 1024 or not (estimate and lease and max_wait and defaults.rpm
    and defaults.tpm and defaults.mif) or estimate < 0 or estimate > 1e12
    or math.floor(estimate) ~= estimate or lease < 1 or max_wait < 0 then
  return redis.error_reply('ERR acquire: bad arguments')
end
-- The tenants' queues at the key (below): a key of another type (written by hand) refuses
-- the call before anything is written; another tenant's queue is read with pcall.
local err = expect_types({{conf, 'hash'}, {in_flight, 'zset'}, {reserved, 'zset'},
  {conf .. ':fair', 'zset'}, {conf .. ':vt', 'hash'}, {conf .. ':calls', 'hash'},
  {conf .. ':q:' .. tenant, 'zset'}})
if err then return err end

local BUSY_WAIT_MS = 100
local REOPEN_SPACING_MS = 50
-- An unused reservation lapses this long after its turn (its caller never came back).
local RESERVATION_GRACE_MS = 600000
local PURGE = 100
-- Tenant-fair turns: how far ahead turns are committed (at least one request interval), the
-- most turns one call hands out, how long a queued call waits for its caller after the time
-- it was told to come back.
local FAIR_HORIZON_MS = 250
local FILL_MAX = 32
local QUEUE_GRACE_MS = 60000
local MAX_VT_TENANTS = 10000

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

-- The key's next free turn (the latest of now, the pause's end, the rates' arrival times).
local function next_turn()
  local at, why = now, ''
  if paused then at, why = pu, 'paused' end
  if rpm > 0 and tr > at then at, why = tr, 'rpm' end
  if tpm > 0 and tt > at then at, why = tt, 'tpm' end
  return at, why
end

-- Charge a turn at `at` for a call of `tokens`: the rates' arrival times move on.
local function charge(at, tokens)
  if rpm > 0 then tr = at + 60000 / rpm; rcall('HSET', conf, 'tr', tr) end
  if tpm > 0 then tt = at + tokens * 60000 / tpm; rcall('HSET', conf, 'tt', tt) end
end

local function keep(cid, at, tokens)
  rcall('ZADD', reserved, at, cid)
  rcall('HSET', conf, 'r:' .. cid, string.format('%.3f', at) .. ':' .. tokens)
end

if rpm == 0 and tpm == 0 then
  -- No rate: nothing to share out but the reopening after a pause, one caller every
  -- REOPEN_SPACING_MS, in order.
  local at, why = next_turn()
  if paused then
    if nf > at then at = nf end
    rcall('HSET', conf, 'nf', at + REOPEN_SPACING_MS)
  end
  local wait = at - now
  if wait <= max_wait then return grant(wait, why, estimate) end
  keep(id, at, estimate)
  return {2, wait, why, estimate}
end

local fair, vts, calls = conf .. ':fair', conf .. ':vt', conf .. ':calls'
local function queue_key(t) return conf .. ':q:' .. t end
local horizon = FAIR_HORIZON_MS
if rpm > 0 then horizon = math.max(horizon, 60000 / rpm) end
local at, why = next_turn()
local queue = queue_key(tenant)
local place = rcall('ZSCORE', queue, id)

-- Uncontended: no call waits and the next turn is within the horizon: take it now.
if not place and at <= now + horizon and rcall('EXISTS', fair) == 0 then
  charge(at, estimate)
  local wait = at - now
  if wait <= max_wait then return grant(wait, why, estimate) end
  keep(id, at, estimate)
  return {2, wait, why, estimate}
end

-- A tenant's virtual time and weight ("<vt> <weight>"), and the key's virtual clock.
local function tenant_vt(t)
  local v = rcall('HGET', vts, t)
  local vt, w = string.match(v or '', '^(%S+) (%S+)$')
  return tonumber(vt) or 0, tonumber(w) or 1
end
local clock = tonumber(rcall('HGET', vts, VCLOCK)) or 0

-- Queue this call (a call already queued keeps its place; its weight may have changed).
local _, old_weight = tenant_vt(tenant)
if place then why = 'reserved' end  -- back for its turn: it waited for it
if not place then
  place = now + (5 - prio) * PRIORITY_STEP_MS
  rcall('ZADD', queue, place, id)
end
if not rcall('ZSCORE', fair, tenant) then
  if rcall('HLEN', vts) > MAX_VT_TENANTS then rcall('DEL', vts); clock = 0 end
  -- At the clock at most (no credit for being away); a tie goes to the tenant that joined
  -- first (it waits: the others' calls went at once).
  local vt = tenant_vt(tenant)
  rcall('ZADD', fair, math.max(vt, clock) + 1e-9 * rcall('ZCARD', fair), tenant)
end
if old_weight ~= weight or not rcall('HEXISTS', vts, tenant) then
  local vt = tenant_vt(tenant)
  rcall('HSET', vts, tenant, string.format('%.17g %.17g', vt, weight))
end

-- Hand the turns within the horizon to the queued calls, in fair order. A popped call whose
-- caller is long gone is dropped, not served.
local handed = 0
for _ = 1, 4 * FILL_MAX do
  if handed >= FILL_MAX then break end
  local next_at = next_turn()
  if next_at > now + horizon then break end
  local top = rcall('ZRANGE', fair, 0, 0)
  if not top[1] then break end
  local t = top[1]
  local popped = redis.pcall('ZPOPMIN', queue_key(t))
  local cid = type(popped) == 'table' and not popped['err'] and popped[1] or nil
  if cid then
    local info = rcall('HGET', calls, cid)
    rcall('HDEL', calls, cid)
    local n, lease_end = string.match(info or '', '^(%d+) (%d+)$')
    n, lease_end = tonumber(n), tonumber(lease_end)
    if cid == id then n, lease_end = estimate, now + 1 end
    if n and lease_end and lease_end > now then
      charge(next_at, n)
      keep(cid, next_at, n)
      handed = handed + 1
      -- The tenant served: its virtual time moves on by 1 / weight from the clock.
      local vt, w = tenant_vt(t)
      local start = math.max(vt, clock)
      clock = start
      rcall('HSET', vts, t, string.format('%.17g %.17g', start + 1 / w, w), VCLOCK, clock)
    end
  end
  if not cid or rcall('EXISTS', queue_key(t)) == 0 then
    rcall('ZREM', fair, t)
  else
    rcall('ZADD', fair, math.max((tenant_vt(t)), clock), t)
  end
end

-- This call's turn, if it was handed one.
local mine = rcall('HGET', conf, 'r:' .. id)
if mine then
  local turn = tonumber(string.match(mine, '^([%d.]+):'))
  local wait = math.max(0, turn - now)
  if wait <= max_wait then
    forget(id)
    return grant(wait, why, estimate)
  end
  return {2, wait, why, estimate}
end

-- Still queued: when to come back, from its place in the fair order times the interval. The
-- fair order serves the smallest virtual start: this call's is its tenant's start plus
-- rank / weight, and another tenant's j-th queued call's is its start plus j / its weight, so
-- the calls that go before it are counted per tenant (as the queues stand now).
at, why = next_turn()
if why == '' then why = rpm > 0 and 'rpm' or 'tpm' end
local rank = tonumber(rcall('ZRANK', queue, id)) or 0
local ahead = rank
local rows = rcall('ZRANGE', fair, 0, TENANT_SCAN - 1, 'WITHSCORES')
local mine_start = tonumber(rcall('ZSCORE', fair, tenant)) or clock
local _, my_weight = tenant_vt(tenant)
local my_vstart = mine_start + rank / my_weight
for i = 1, #rows, 2 do
  local u = rows[i]
  if u ~= tenant then
    local _, w = tenant_vt(u)
    local before_me = math.ceil((my_vstart - tonumber(rows[i + 1])) * w)
    local queued = tonumber(redis.pcall('ZCARD', queue_key(u))) or 0
    ahead = ahead + math.max(0, math.min(queued, before_me))
  end
end
local interval = 0
if rpm > 0 then interval = 60000 / rpm end
if tpm > 0 then interval = math.max(interval, estimate * 60000 / tpm) end
local wait = math.max(at - now + ahead * interval, BUSY_WAIT_MS)
rcall('HSET', calls, id, estimate .. ' ' .. math.floor(now + wait + QUEUE_GRACE_MS))
return {2, math.floor(wait), why, 0}
