--[[
  erase: reset or delete one session, fenced against a step running for it. The lock is
  deleted in the same step, so the running step's commit (or release, or partial text) is
  refused by the token check and writes nothing: no key of the session comes back.

  reset   the state document becomes ARGV[3] (the initial state: history cleared), the
          version moves on (a commit that read the old one is refused too); the messages
          waiting in the session are kept and processed in order from there (the one that
          was running, or waiting for a person, runs again, on the new state, with nothing
          journaled: its steps' journals and its parked interrupt are deleted); timers,
          dedupe keys and cancel marks are kept.
  delete  every key of the session: its state hash (with the waiting messages and a parked
          interrupt), lock, timers (and their places in the shard's timer set, an
          interrupt's timeout too), the ended interrupts' ids, and every key named by a
          msg_id of its index (dedupe keys, cancel marks, partial-reply streams, step
          journals, the console's record of each message's life: see
          index_msg_id in _common.lua), then the index; it leaves the ready set and the ages.
          A later message starts a new session (seq 1). Cost: one DEL per indexed msg_id
          (about the messages of one dedupe window), no scan. The session's dead letters
          and reply events are in shard-wide streams: the client removes the letters.

          With the session go the console's indexes of it: its dead-letter index, its msg_ids
          in the shard's msg_id -> session hashes (when they still name it) and its place in
          the recent sessions' buckets (the current and the previous one).

  KEYS[1] ready set   KEYS[2] session key prefix
  ARGV[1] 'reset' | 'delete'   ARGV[2] session_id   ARGV[3] initial state JSON (reset)
  ARGV[4] DIALOG_DEDUPE_TTL_S (delete; optional): the length of a recent-sessions bucket

  Returns {found (1 when the session had a state or a lock, else 0), keys deleted, waiting
  messages (reset: kept; delete: removed), timers removed, was a step running (1/0)}
]]
local ready, sprefix = KEYS[1], KEYS[2]
local mode, sid = ARGV[1], ARGV[2]
if (mode ~= 'reset' and mode ~= 'delete') or not sid or #sid == 0 or #sid > 256
    or (mode == 'reset' and not ARGV[3]) then
  return redis.error_reply('ERR erase: bad arguments')
end
local state, lock = session_key(sprefix, sid, 'state'), session_key(sprefix, sid, 'lock')
local tkey, ikey = session_key(sprefix, sid, 'timers'), session_key(sprefix, sid, 'ids')
for _, check in ipairs({{ready, 'zset'}, {state, 'hash'}, {tkey, 'hash'}, {ikey, 'zset'},
                        {await_key(sprefix, sid), 'string'},
                        {timers_key(ready), 'zset'}}) do
  local err = expect_type(check[1], check[2])
  if err then return err end
end

local h = rcall('HMGET', state, 'a', 's', 'v', 'T', 'w')
local applied, last = tonumber(h[1]) or 0, tonumber(h[2]) or 0
local running = rcall('EXISTS', lock)
local found = (h[3] or running == 1) and 1 or 0
local waiting = math.max(0, last - applied)
local now = now_ms()
local ids = rcall('ZRANGE', ikey, 0, -1)
rcall('DEL', lock)
-- Step journals and a parked interrupt go with either: the journal of the parked message is
-- named by the state (its msg_id may have left the index: a wait can outlast it).
local journals = 0
for _, msg_id in ipairs(ids) do
  journals = journals + rcall('DEL', journal_key(sprefix, sid, msg_id))
end
local parked = rcall('GET', await_key(sprefix, sid))
local parked_on = h[5] or (parked and interrupt_record(parked)['msg_id'])
if type(parked_on) == 'string' then
  journals = journals + rcall('DEL', journal_key(sprefix, sid, parked_on))
end
if parked or h[5] then
  rcall('DEL', await_key(sprefix, sid))
  rcall('ZREM', timers_key(ready), sid .. '\n' .. AWAIT_TIMER)
end
busy_leave(ready, sid, h[4])  -- its step (if one ran) no longer counts in flight

if mode == 'reset' then
  if rcall('EXISTS', state) == 1 then
    if h[4] then rcall('HDEL', state, 'T') end
    rcall('HSET', state, 'd', ARGV[3])
    rcall('HINCRBY', state, 'v', 1)
    rcall('HDEL', state, 'c', 'w')  -- no commit is answered as already written any more
    if parked then  -- it was parked: its message runs again, as outstanding work (the ages)
      local rec = interrupt_record(parked)
      redis.pcall('ZADD', ages_key(ready), entry_ms(tostring(rec['entry_id'] or '')), sid)
    end
    if last > applied then rcall('ZADD', ready, now, sid) end  -- the waiting ones go on now
  end
  return {found, 0, waiting, 0, running}
end

local deleted, timers = 0, 0
local all = rcall('HGETALL', tkey)
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 2) == 't:' then
    rcall('ZREM', timers_key(ready), sid .. '\n' .. string.sub(all[i], 3))
    timers = timers + 1
  end
end
for _, msg_id in ipairs(ids) do
  deleted = deleted + rcall('DEL', session_key(sprefix, sid, 'msg:' .. msg_id),
                            cancel_key(sprefix, sid, msg_id),
                            session_key(sprefix, sid, 'partial:' .. msg_id),
                            session_key(sprefix, sid, 'life:' .. msg_id))
  -- The console's find as versions before the quarter hashes kept it: a key per msg_id
  -- (it lives one dedupe window).
  local found_by = ready .. ':msg:' .. msg_id
  if redis.pcall('GET', found_by) == sid then deleted = deleted + rcall('DEL', found_by) end
end
deleted = deleted + rcall('DEL', state, tkey, ikey, session_key(sprefix, sid, 'letters'))
  + running + journals + rcall('DEL', session_key(sprefix, sid, 'interrupts'))
local bucket_ms = (tonumber(ARGV[4]) or 0) * 1000
if bucket_ms > 0 then
  local current = math.floor(now / bucket_ms)
  for _, b in ipairs({current, current - 1}) do
    redis.pcall('ZREM', ready .. ':sessions:' .. b, sid)
  end
  local quarter = find_quarter(now, bucket_ms / 1000)  -- the console's find (intake-5.lua)
  for q = quarter - FIND_PERIODS, quarter do
    local found_in = ready .. ':msgs:' .. q
    for _, msg_id in ipairs(ids) do
      if redis.pcall('HGET', found_in, msg_id) == sid then redis.pcall('HDEL', found_in, msg_id) end
    end
  end
end
rcall('ZREM', ready, sid)
rcall('ZREM', ages_key(ready), sid)
-- Its place in a tenant's queue, if it waits in one (the queues of the tenants with sessions
-- waiting: a session stays in none after it is taken from it).
local waiting_tenants = redis.pcall('ZRANGE', active_key(ready), 0, TENANT_SCAN - 1)
if type(waiting_tenants) == 'table' and not waiting_tenants['err'] then
  for _, t in ipairs(waiting_tenants) do redis.pcall('ZREM', runq_key(ready, t), sid) end
end
return {found, deleted, waiting, timers, running}
