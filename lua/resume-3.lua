--[[
  resume: take up sessions of the ready set that are due: their lock lease ran out (the holder
  crashed or hangs), their retry backoff is over, or a hand-off could not happen. For each due
  session, atomically:
    lock held           look again when its lease ends (the holder renews it while alive)
    nothing outstanding leave the ready set
    held                leave the ready set (an operator's release or redrive puts it back)
    parked              its next message waits for a person (interrupt-3.lua): leave the
                        ready set, unless the wait is over: the message was cancelled or
                        superseded meanwhile (it is unparked and ends without a step), or
                        the interrupt's timeout is due (recorded as the interrupt's end;
                        unparked, the message is handed out). A session whose await key
                        is gone was resumed: its state's marker goes, and it is handed out
    next message there  take the lock, count the attempt, return the job with the message
                        (from the session's keys, where intake put it: custody), and
                        whether it ends without a step (cancelled or superseded: see
                        ending_of in _common.lua)
    next message missing  (its q<seq> field deleted by hand or lost; or, for a message
                        sequenced before custody, its entry deleted from the stream) wait
                        DIALOG_GAP_TIMEOUT_S from when the gap was first seen, then take the
                        lock and return a gap job: the caller dead-letters that seq (gap)
                        and the session moves on

  KEYS[1] inbound stream   KEYS[2] ready set   KEYS[3] session key prefix

  ARGV[1] most sessions to take (1..1000)   ARGV[2] token base (unique per call)
  ARGV[3] lock ttl (ms)   ARGV[4] gap timeout (ms)
  ARGV[5] DIALOG_TENANT_PATTERN as a Lua pattern (optional)
  ARGV[6] merged bursts: "default policy,window ms,longest wait ms" (optional; see merge_parts
          in _common.lua): a session whose next message opens a burst to merge waits for its
          window to close, then its job carries the burst's later parts

  Sessions whose next message may start go through the tenants' queues as at intake (taken at
  once while the queues are empty and the call has room for them all, else queued, and the
  call's room handed out in fair order: dispatch in _common.lua); a call with room and nothing
  due still hands queued sessions out.

  Sent twice with the same token base (a lost reply), the call returns its first jobs again.

  Returns {jobs, ms until the next session is due (-1: none)}
    jobs  {kind ("m" message | "g" gap), session_id, token, seq, entry id, fields,
           state JSON, version, attempts, first_failed_at, last_error,
           ending ('' | 'cancelled' | 'superseded')}
]]
local stream, ready, sprefix = KEYS[1], KEYS[2], KEYS[3]
local count, lock_ttl, gap_timeout = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4])
if not (count and lock_ttl and gap_timeout) or count < 1 or count > 1000 then
  return redis.error_reply('ERR resume: bad arguments')
end
for _, check in ipairs({{stream, 'stream'}, {ready, 'zset'}, {active_key(ready), 'zset'},
                        {vt_key(ready), 'hash'}}) do
  local err = expect_type(check[1], check[2])
  if err then return err end
end

local function job_row(kind, sid, token, seq, id, fields, h, ending)
  if not ending then
    ending = ''
    if kind == 'm' then ending = ending_of(sprefix, sid, seq, msg_id_of(id, fields), h[7], h[8]) end
  end
  return {kind, sid, token, seq, id, fields, h[1] or '', h[2] or '0', (tonumber(h[3]) or 0),
          h[4] or '', h[5] or '', ending}
end

local replayed = replay_receipt(ready, ARGV[2], sprefix, stream, job_row)
if replayed then
  return {replayed, 0}
end

local now = now_ms()
local jobs, tokens, receipt, runnable, parts_of = {}, 0, {}, {}, {}
local merge = merge_spec(ARGV[6])

for _, sid in ipairs(rcall('ZRANGEBYSCORE', ready, '-inf', now, 'LIMIT', 0, count)) do
  local state, lock = session_key(sprefix, sid, 'state'), session_key(sprefix, sid, 'lock')
  local pttl = rcall('PTTL', lock)
  if pttl == -1 then
    rcall('DEL', lock)  -- a lock without a lease is not ours to respect (written by hand)
    pttl = -2
  end
  local holder = pttl > 0 and holder_of(redis.pcall('GET', lock))
  if holder and not lease_alive(ready, holder, now) then
    rcall('DEL', lock)  -- its worker's lease lapsed (see the worker leases in _common.lua)
    pttl = -2
  end
  if pttl > 0 then
    rcall('ZADD', ready, holder and held_place(holder) or now + pttl, sid)
  else
    -- pcall: a state key of another type (written by hand) must not fail the call after it
    -- took earlier sessions' locks; that session is looked at again in a minute, alone.
    local h = redis.pcall('HMGET', state, 'a', 's', 'd', 'v', 'n', 'f', 'e', 'g', 'xc', 'xs', 'h',
                          'T', 'w')
    local applied, last = 0, 0
    if h['err'] then
      rcall('ZADD', ready, now + 60000, sid)
    else
      applied, last = tonumber(h[1]) or 0, tonumber(h[2]) or 0
    end
    if h['err'] then
      -- skipped
    elseif last <= applied then
      rcall('ZREM', ready, sid)
    elseif h[11] then
      rcall('ZREM', ready, sid)  -- held: a release or redrive puts it back (hold-3.lua)
    else
      local seq = applied + 1
      local stored = rcall('HGET', state, 'q' .. seq)
      local id, fields = load_message(stream, stored)
      if not id and stored and string.find(stored, '^%d+%-%d+$') then
        id = stored  -- an entry id from before custody: the gap event names it
      end
      local kind, gap_since = 'm', tonumber(h[8])
      local rec = h[13] and interrupt_record(redis.pcall('GET', await_key(sprefix, sid)))
      if rec and rec['msg_id'] == nil then
        -- Resumed (resolve-2.lua took the await key): it goes on, and its journal gets an
        -- expiry again (a safety net only: its commit deletes it).
        rcall('HDEL', state, 'w')
        redis.pcall('EXPIRE', journal_key(sprefix, sid, h[13]), INTERRUPTS_KEPT_S)
      elseif rec and fields and msg_id_of(id, fields) == rec['msg_id'] then
        -- Parked: its message waits for a person (interrupt-3.lua). The wait ends here when
        -- the message ends without a step (cancelled, superseded) or its timeout is due
        -- (recorded as the interrupt's end: the re-run's interrupt() raises InterruptTimeout).
        local ending = ending_of(sprefix, sid, seq, rec['msg_id'], h[9], h[10])
        local timeout_at = tonumber(rec['timeout_at']) or 0
        if ending ~= '' then
          unpark(ready, sprefix, sid, rec, '{"ended":"' .. ending .. '"}')
        elseif timeout_at > 0 and now >= timeout_at then
          unpark(ready, sprefix, sid, rec, '{"timeout":true}')
        else
          kind = 'p'
          rcall('ZREM', ready, sid)  -- a resume, its timeout or a cancel brings it back
        end
      end
      if kind == 'p' then
        -- parked
      elseif not fields then
        kind = 'g'
        if not gap_since then
          rcall('HSET', state, 'g', now)
          rcall('ZADD', ready, now + gap_timeout, sid)
        elseif now - gap_since < gap_timeout then
          rcall('ZADD', ready, gap_since + gap_timeout, sid)
        else
          kind = 'G'
        end
      end
      if kind == 'm' and merge.window > 0 and is_merge_part(fields, merge)
          and ending_of(sprefix, sid, seq, msg_id_of(id, fields), h[9], h[10]) == '' then
        -- The first of a burst to merge: handed out once its window closed, with its parts.
        local parts, close = merge_parts(stream, sprefix, sid, state, seq, id, last, h[9], h[10],
                                         merge)
        if close > now then
          kind = 'w'
          rcall('ZADD', ready, close, sid)
        else
          parts_of[sid] = parts
        end
      end
      if kind == 'm' then
        runnable[#runnable + 1] = {sid, seq, id, fields, h, state}
      elseif kind == 'G' then
        tokens = tokens + 1
        local token = ARGV[2] .. ':' .. tokens
        local attempts = (tonumber(h[5]) or 0) + 1
        rcall('SET', lock, token, 'PX', lock_ttl)
        rcall('HSET', state, 'n', attempts)
        rcall('ZADD', ready, held_until(now, lock_ttl, token), sid)
        jobs[#jobs + 1] = {'g', sid, token, seq, id or '', {}, h[3] or '', h[4] or '0',
                           attempts, h[6] or '', h[7] or '', ''}
        receipt[#receipt + 1] = {'g', sid, token, seq, id or '', ''}
      end
    end
  end
end

-- Sessions whose next message may start: as at intake (see the tenants in _common.lua), each
-- takes its lock now while no session waits in the shard's queues and the call has room for
-- all; otherwise they join their tenants' queues and the call's room goes out in fair order.
local sched = scheduler(ready, sprefix, stream, now, lock_ttl, ARGV[2], ARGV[5] or '')
sched.merge = merge
local room = count - #jobs
local wanted = {}
for _, r in ipairs(runnable) do
  busy_leave(ready, r[1], r[5][12])  -- its last holder's lease ran out: no longer in flight
  r[7] = tenant_of(r[4], r[1], sched.pattern)
  wanted[r[7]] = (wanted[r[7]] or 0) + 1
end
if #runnable <= room and all_fit(sched, wanted) then
  for _, r in ipairs(runnable) do
    local sid, seq, id, fields, h, state = r[1], r[2], r[3], r[4], r[5], r[6]
    tokens = tokens + 1
    local token = ARGV[2] .. ':' .. tokens
    local attempts = (tonumber(h[5]) or 0) + 1
    local tenant = r[7]
    rcall('SET', session_key(sprefix, sid, 'lock'), token, 'PX', lock_ttl)
    busy_add(sched, tenant, sid)
    rcall('HSET', state, 'n', attempts, 'T', tenant)
    rcall('ZADD', ready, held_until(now, lock_ttl, token), sid)
    local ending = ending_of(sprefix, sid, seq, msg_id_of(id, fields), h[9], h[10])
    jobs[#jobs + 1] = {'m', sid, token, seq, id, fields, h[3] or '', h[4] or '0', attempts,
                       h[6] or '', h[7] or '', ending, parts_of[sid] or {}}
    receipt[#receipt + 1] = {'m', sid, token, seq, id, ending}
  end
else
  for _, r in ipairs(runnable) do
    enqueue(sched, r[1], r[4], entry_order(r[3]))
  end
  if room > 0 then
    for _, row in ipairs(dispatch(sched, room)) do
      table.insert(row, 1, 'm')
      jobs[#jobs + 1] = row
    end
    for _, item in ipairs(sched.receipt) do receipt[#receipt + 1] = item end
  end
end

if #receipt > 0 then
  save_receipt(ready, ARGV[2], lock_ttl, receipt)
end

local head = rcall('ZRANGE', ready, 0, 0, 'WITHSCORES')
local wait = -1
if #head > 0 then
  wait = math.max(0, tonumber(head[2]) - now)
end
return {jobs, wait}
