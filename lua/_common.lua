--[[
  Shared prelude, prepended to every script of this folder when it is loaded (see
  worker/dialog_worker/store/scripts.py). Only pure helpers live here: no script logic.

  Session keys are derived inside the scripts from a declared key prefix that carries the
  shard's Cluster hash tag ("<prefix>:{<tag>}:s:"), so every key a script touches lives in the
  declared slot. The session id is escaped (% { } percent-encoded) and wrapped in braces after
  the tag: only the first brace pair is a hash tag, and the escaped id's closing brace is
  unambiguous, so no two sessions' keys can collide.
]]
local rcall = redis.call

local function now_ms()
  local t = rcall('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local ESCAPES = {['%'] = '%25', ['{'] = '%7B', ['}'] = '%7D'}

local function session_key(prefix, session_id, role)
  local escaped = string.gsub(session_id, '[%%{}]', ESCAPES)
  return prefix .. '{' .. escaped .. '}:' .. role
end

-- A reply event (the fields every outcome carries, then extra name/value pairs when given:
-- rich replies, echoed producer fields), trimmed with MAXLEN ~ when maxlen > 0.
local function reply_event(replies, maxlen, sid, msg_id, seq, outcome, text, now, entry_id, extra)
  local event = {'session_id', sid, 'msg_id', msg_id, 'seq', seq, 'outcome', outcome,
                 'reply', text, 'produced_at', now, 'entry_id', entry_id}
  for _, v in ipairs(extra or {}) do event[#event + 1] = v end
  if maxlen > 0 then
    rcall('XADD', replies, 'MAXLEN', '~', maxlen, '*', unpack(event))
  else
    rcall('XADD', replies, '*', unpack(event))
  end
end

-- The original fields of an entry for its dead letter, byte for byte. Lua's unpack fails on a
-- few thousand values, so an entry with more fields than that is kept whole in one field,
-- raw_entry (a JSON array of its names and values), instead of field by field.
local MAX_COPIED_VALUES = 2000

local function letter_fields(fields)
  local letter = {}
  if #fields <= MAX_COPIED_VALUES then
    for i = 1, #fields do
      letter[i] = fields[i]
    end
  else
    letter[1] = 'raw_entry'
    letter[2] = cjson.encode(fields)
  end
  return letter
end

-- Fail the whole call before its first write when a shared key has the wrong type (written by
-- hand, or a name clash): Redis keeps a script's writes when a later command fails.
local function expect_type(key, wanted)
  local t = rcall('TYPE', key)['ok']
  if t ~= 'none' and t ~= wanted then
    return redis.error_reply('WRONGTYPE ' .. key .. ' is a ' .. t .. ', expected a ' .. wanted)
  end
  return nil
end

-- expect_type for each {key, type} of checks, in order: the first error, or nil.
local function expect_types(checks)
  for _, check in ipairs(checks) do
    local err = expect_type(check[1], check[2])
    if err then return err end
  end
  return nil
end

-- expect_type(key, 'stream') for several keys in one command: an XREAD from each one's last
-- id ($) reads nothing, but looks every key up first and fails on one that is not a stream.
-- Only then (or when XREAD is not allowed) is each key's TYPE read, for the error naming it.
local function expect_streams(keys)
  if #keys == 0 then return nil end
  local args = {'XREAD', 'COUNT', 1, 'STREAMS'}
  for _, key in ipairs(keys) do args[#args + 1] = key end
  for _ = 1, #keys do args[#args + 1] = '$' end
  local got = redis.pcall(unpack(args))
  if type(got) == 'table' and got['err'] then
    for _, key in ipairs(keys) do
      local err = expect_type(key, 'stream')
      if err then return err end
    end
  end
  return nil
end

-- Receipts make the calls that hand out locks safe to send twice (a cluster client re-sends a
-- call whose reply was lost): the call records, for its token base, which jobs it returned;
-- the same call again returns those jobs (while their locks are still its) instead of taking
-- new work and leaving the first jobs to wait out their leases. Kept one lock lease.
local function receipt_key(ready, token_base)
  return ready .. ':receipt:' .. token_base
end

-- (At most RECEIPT_KEPT_MS: a re-sent call comes within seconds, and locks taken under a
-- worker lease live far longer than a lease.)
local RECEIPT_KEPT_MS = 30000

local function save_receipt(ready, token_base, ttl_ms, jobs)
  rcall('SET', receipt_key(ready, token_base), cjson.encode(jobs), 'PX',
        math.min(ttl_ms, RECEIPT_KEPT_MS))
end

-- Custody. Once sequenced, a message lives in its session's state hash, field q<seq>: its
-- entry id and its fields, byte for byte, packed with cmsgpack (compact, binary-safe), so no
-- command on the inbound stream can touch it. The worker decodes the same format
-- (dialog_worker.store.codec.unpack_custody).
local function pack_message(id, fields)
  return cmsgpack.pack(id, fields)
end

-- The entry id and fields of a sequenced message from the value of its q<seq> field, or nil
-- when there is none (deleted by hand, lost). A value written before custody is a plain entry
-- id whose entry is still in the stream: it is read from there (legacy = true).
local function load_message(stream, value)
  if not value then return nil end
  if string.find(value, '^%d+%-%d+$') then
    local rows = rcall('XRANGE', stream, value, value)
    if rows[1] then return value, rows[1][2], true end
    return nil
  end
  local ok, id, fields = pcall(cmsgpack.unpack, value)
  if ok and type(id) == 'string' and type(fields) == 'table' then
    return id, fields, false
  end
  return nil
end

-- Bookkeeping of the inbound stream, next to the ready set (one small hash per stream):
-- added/length as the last intake call left them, trimmed (unread entries something other
-- than a worker removed since), ahead (the stream's last id, while it is far ahead of the
-- clock). Read by `stats`; see intake-5.lua.
local function inbound_key(ready)
  return ready .. ':inbound'
end

-- Sessions with messages outstanding -> when their next message was appended (ms, from its
-- entry id), so the oldest outstanding message is found in O(log n) (`stats`, the sampler):
-- the inbound stream no longer holds sequenced messages. Kept by intake and commit.
local function ages_key(ready)
  return ready .. ':ages'
end

local function entry_ms(id)
  return tonumber(string.match(id, '^(%d+)')) or 0
end

-- An entry id as a number that keeps the ids' order (ms, then the sequence within the ms as
-- a fraction, exact for the first thousand entries of a ms).
local function entry_order(id)
  local ms, seq = string.match(id, '^(%d+)%-(%d+)$')
  return (tonumber(ms) or 0) + math.min(tonumber(seq) or 0, 999) / 1000
end

-- The order of a session queued now behind the others (one that gave its slot up): after
-- every entry appended by now, those of this very millisecond too (at most now + 0.999). An
-- entry with an id ahead of Redis's clock (the clock stepped back) can still be behind it.
local function behind_at(now)
  return now + 0.9995
end

-- The jobs of a receipt whose locks are still ours, with their state and fields read again.
-- Each receipt item is {kind, session_id, token, seq, entry id, ending}; rows are built by
-- `row` (h: d, v, n, f, e, q<seq>, xc, xs of the session's state), with the ending the first
-- call gave (a later entry of that call, or one appended since, must not change it).
local function replay_receipt(ready, token_base, sprefix, stream, row)
  local saved = rcall('GET', receipt_key(ready, token_base))
  if not saved then return nil end
  local jobs = {}
  for _, item in ipairs(cjson.decode(saved)) do
    local kind, sid, token, seq, id = item[1], item[2], item[3], item[4], item[5]
    if rcall('GET', session_key(sprefix, sid, 'lock')) == token then
      local h = rcall('HMGET', session_key(sprefix, sid, 'state'), 'd', 'v', 'n', 'f', 'e',
                      'q' .. seq, 'xc', 'xs')
      local _, fields = load_message(stream, h[6])
      jobs[#jobs + 1] = row(kind, sid, token, seq, id, fields or {}, h, item[6])
    end
  end
  return jobs
end

-- Each session's dead letters, newest LETTERS_KEPT (a zset <session>:letters, entry id ->
-- its ms), so the console's session page reads them without reading the dead-letter stream.
-- Written with the letter; removed when it is redriven or purged (worker/dialog_worker/ops/dead_letters.py, hold-3.lua).
-- <ready set>:letters-since holds the first letter indexed: older ones were written before
-- the index existed and are found by reading the stream (bounded) instead.
-- pcall: a key of another type (written by hand) must not fail the call after its writes.
local LETTERS_KEPT = 1000

local function letters_key(sprefix, sid)
  return session_key(sprefix, sid, 'letters')
end

local function index_letter(ready, sprefix, sid, letter_id)
  redis.pcall('SET', ready .. ':letters-since', letter_id, 'NX')
  local key = letters_key(sprefix, sid)
  if type(redis.pcall('ZADD', key, entry_ms(letter_id), letter_id)) == 'number' then
    redis.pcall('ZREMRANGEBYRANK', key, 0, -(LETTERS_KEPT + 1))
  end
end

-- Cancellation (see cancel-1.lua). A message ends without a step, in its turn, when:
--   its cancel mark exists (key <session>:cancel:<msg_id>, written by a cancel or by an
--     interrupting message; found by msg_id, so a mark may come before its message), or
--     its seq is below the state hash's xc field (an interrupting message: everything
--     outstanding before it ends cancelled)                            -> 'cancelled'
--   its seq is below the state hash's xs field (a coalescing message supersedes everything
--     waiting before it), or its cancel mark holds SUPERSEDED_MARK     -> 'superseded'
-- A message already running when xs moved on is not stopped by it: xs is checked only when a
-- message is handed out. Returns '' when the message goes on.
-- A redrive into a held session (hold-3.lua) puts dead letters in front of the waiting
-- messages: xc and xs would then cover the letters too, so it marks each waiting message they
-- covered instead (a cancel mark, or SUPERSEDED_MARK) and removes them.
local SUPERSEDED_MARK = 'superseded'

local function cancel_key(sprefix, sid, msg_id)
  return session_key(sprefix, sid, 'cancel:' .. msg_id)
end

-- The msg_id of a sequenced message: its msg_id field, else its entry id.
local function msg_id_of(id, fields)
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'msg_id' then return fields[i + 1] end
  end
  return id
end

-- A cancel mark for a message that may be running: the shard's cancel count (a key beside
-- the session keys: no session key is named without a brace after the prefix) moves on, and
-- a note is appended to the shard's cancel notes (a short stream), so the workers' cancel
-- watch reads one key per look, or blocks on the notes while every step it runs was looked
-- at, and the marks of their running steps only when one came (Pipeline.watch_cancels).
local function note_cancel(sprefix)
  redis.pcall('INCR', sprefix .. 'cancels')
  redis.pcall('XADD', sprefix .. 'cancel-notes', 'MAXLEN', '~', 64, '*', 'n', 1)
end

local function ending_of(sprefix, sid, seq, msg_id, xc, xs)
  if xc and (tonumber(xc) or 0) > seq then return 'cancelled' end
  -- A key of another type answers an error (a table): a mark, as it always was.
  local mark = redis.pcall('GET', cancel_key(sprefix, sid, msg_id))
  if mark == SUPERSEDED_MARK then return 'superseded' end
  if mark then return 'cancelled' end
  if xs and (tonumber(xs) or 0) > seq then return 'superseded' end
  return ''
end

-- Timers (lua/fire-3.lua fires them). A timer of a session is a message to be appended to its
-- inbound stream when due. Per shard, a sorted set <ready>:timers holds "<session_id>\n<name>"
-- by due time (ms), so the fire script finds the due ones in O(log n) without a scan; per
-- session, a hash <session>:timers holds each timer's payload (field t:<name>: due ms,
-- whether a user message cancels it, the entry's fields, packed with cmsgpack) and, in
-- field c, how many of them a user message cancels. Session ids and timer names contain no
-- control characters (checked at intake and by the client), so "\n" separates them.
-- At most MAX_TIMERS timers per session.
local MAX_TIMERS = 64
local MAX_TIMER_NAME_BYTES = 128

local function timers_key(ready)
  return ready .. ':timers'
end

local function timer_problem(name)
  if type(name) ~= 'string' or #name == 0 or #name > MAX_TIMER_NAME_BYTES
      or string.find(name, '%c') then
    return 'timer name must be 1 to ' .. MAX_TIMER_NAME_BYTES .. ' bytes without control characters'
  end
  return nil
end

-- How many timers the session has.
local function timer_count(tkey)
  local n = rcall('HLEN', tkey)
  if rcall('HEXISTS', tkey, 'c') == 1 then n = n - 1 end
  return n
end

-- Remove one timer; returns its payload, or nil when there was none.
local function drop_timer(ready, sprefix, sid, name)
  local tkey = session_key(sprefix, sid, 'timers')
  local v = redis.pcall('HGET', tkey, 't:' .. name)
  if not v or type(v) == 'table' then return nil end  -- none, or a key of another type
  local ok, _, on_message = pcall(cmsgpack.unpack, v)
  rcall('HDEL', tkey, 't:' .. name)
  if ok and on_message == 1 and rcall('HINCRBY', tkey, 'c', -1) <= 0 then
    rcall('HDEL', tkey, 'c')
  end
  rcall('ZREM', timers_key(ready), sid .. '\n' .. name)
  return v
end

-- Set (or replace) one timer. The caller checked the session's timer count; when it sets one
-- that a user message cancels (on_message), it deletes the state's tc field (see below).
local function set_timer(ready, sprefix, sid, name, due, on_message, fields)
  drop_timer(ready, sprefix, sid, name)
  local tkey = session_key(sprefix, sid, 'timers')
  rcall('HSET', tkey, 't:' .. name, cmsgpack.pack(due, on_message and 1 or 0, fields))
  if on_message then rcall('HINCRBY', tkey, 'c', 1) end
  rcall('ZADD', timers_key(ready), due, sid .. '\n' .. name)
end

-- A user message of the session was sequenced: its timers marked cancel_on_message go (one
-- HGET when it has none; else one HGETALL of at most MAX_TIMERS timers). Intake then writes
-- tc = 0 into the state hash, which it reads anyway: while tc is there the session has no
-- such timer and the next message skips this look. Only a commit sets such a timer, and it
-- deletes tc with its own writes; a state that expired or was deleted takes tc with it while
-- the timers stay, so a state without tc is always looked at.
local function cancel_message_timers(ready, sprefix, sid)
  local tkey = session_key(sprefix, sid, 'timers')
  if (tonumber(redis.pcall('HGET', tkey, 'c')) or 0) <= 0 then return end
  local all = rcall('HGETALL', tkey)
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 2) == 't:' then
      local ok, _, on_message = pcall(cmsgpack.unpack, all[i + 1])
      if ok and on_message == 1 then drop_timer(ready, sprefix, sid, string.sub(all[i], 3)) end
    end
  end
end

-- The console finds a message by its msg_id (else entry id) in hashes msg_id -> session id,
-- one per quarter of DIALOG_DEDUPE_TTL_S (<ready>:msgs:<quarter>), written by intake and each
-- kept five quarters: a message is found for at least one dedupe window, and the hashes hold
-- at most a quarter window more. Keys.msg_sessions and the console compute the same names.
local FIND_PERIODS = 4

local function find_quarter(now, dedupe_ttl_s)
  return math.floor(now / (dedupe_ttl_s * 1000 / FIND_PERIODS))
end

-- Every msg_id a session's messages had (explicit or their entry id) -> until when (ms) keys
-- named by it (msg:, cancel:, partial:) may exist: how delete (erase-2.lua) finds them
-- without a scan. index_msg_ids adds the msg_ids one call sequenced for a session, seqs
-- first_seq..last_seq, with one ZADD (a burst's messages share it); expired members are
-- pruned whenever those seqs pass a multiple of 32, so the index holds about one dedupe
-- window of msg_ids. With pcall: a key of another type (written by hand) must not fail the
-- call after its first writes.
-- Its expiry is set two windows ahead, and only when it would come before the newest
-- member's end (until_ms): a caller that knows the expiry set last (intake keeps it in the
-- state hash's ie field, which it reads anyway) passes it as expires_at and gets the new one
-- back (nil when it stays), so a busy session sets it about once a window, not once a call.
-- Every call sets it to now + two windows, so it only moves on and ie never overstates it
-- (an index deleted by hand and made again without one gets it back within a window).
local MAX_INDEXED_PER_ZADD = 500  -- members per ZADD: Lua's unpack fails on a few thousand

local function index_msg_ids(sprefix, sid, msg_ids, first_seq, last_seq, until_ms, ttl_ms,
                             expires_at)
  local ikey = session_key(sprefix, sid, 'ids')
  for i = 1, #msg_ids, MAX_INDEXED_PER_ZADD do
    local args = {}
    for k = i, math.min(i + MAX_INDEXED_PER_ZADD - 1, #msg_ids) do
      args[#args + 1] = until_ms
      args[#args + 1] = msg_ids[k]
    end
    redis.pcall('ZADD', ikey, unpack(args))
  end
  if math.floor(last_seq / 32) > math.floor((first_seq - 1) / 32) then
    redis.pcall('ZREMRANGEBYSCORE', ikey, '-inf', '(' .. (until_ms - ttl_ms))
  end
  if expires_at and expires_at >= until_ms then return nil end
  redis.pcall('PEXPIRE', ikey, 2 * ttl_ms)
  return until_ms + ttl_ms - 1000  -- a second short: PEXPIRE may count from the call's start
end

local function index_msg_id(sprefix, sid, msg_id, seq, until_ms, ttl_ms)
  index_msg_ids(sprefix, sid, {msg_id}, seq, seq, until_ms, ttl_ms)
end

-- Whether a string is valid UTF-8 (RFC 3629: no overlong forms, no surrogates).
local function valid_utf8(s)
  if not string.find(s, '[\128-\255]') then
    return true
  end
  local i, n = 1, #s
  while i <= n do
    local c = string.byte(s, i)
    local len
    if c < 0x80 then len = 1
    elseif c >= 0xC2 and c <= 0xDF then len = 2
    elseif c >= 0xE0 and c <= 0xEF then len = 3
    elseif c >= 0xF0 and c <= 0xF4 then len = 4
    else return false end
    if i + len - 1 > n then return false end
    for k = i + 1, i + len - 1 do
      local cc = string.byte(s, k)
      if cc < 0x80 or cc > 0xBF then return false end
    end
    if len == 3 then
      local c2 = string.byte(s, i + 1)
      if (c == 0xE0 and c2 < 0xA0) or (c == 0xED and c2 > 0x9F) then return false end
    elseif len == 4 then
      local c2 = string.byte(s, i + 1)
      if (c == 0xF0 and c2 < 0x90) or (c == 0xF4 and c2 > 0x8F) then return false end
    end
    i = i + len
  end
  return true
end

--[[
  Merged bursts (multitask=merge): a session's next message whose policy is merge (its
  multitask field, else DIALOG_MULTITASK) is not handed out until its window closes: the
  arrival of the last of the consecutive merge messages from it plus the window, at most
  the first one's arrival plus the longest wait (arrival: the entry id's time). Then one step
  gets all of them that have not ended otherwise (cancelled, superseded), at most MAX_PARTS: the
  job row carries the parts after the first. A session waiting for its window is in the ready
  set until it closes (resume hands it out then).
  `merge`: {policy = the default policy, window = ms, max = ms}, from a script's argument
  "policy,window_ms,max_ms" (merge_spec).
]]
local MAX_PARTS = 32

local function merge_spec(arg)
  local policy, window, longest = string.match(arg or '', '^(%a+),(%d+),(%d+)$')
  return {policy = policy or 'enqueue', window = tonumber(window) or 0,
          max = tonumber(longest) or 0}
end

local function is_merge_part(fields, merge)
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'multitask' then return fields[i + 1] == 'merge' end
  end
  return merge.policy == 'merge'
end

-- The merge parts after a first one (seq, entry id, fields, of a merge message): {{seq, id,
-- fields}...}, and when the window closes (ms; 0 once MAX_PARTS are there).
local function merge_parts(stream, sprefix, sid, state, seq, id, last, xc, xs, merge)
  local first_ms = entry_ms(id)
  local latest = first_ms
  local parts = {}
  for k = seq + 1, math.min(last, seq + MAX_PARTS - 1) do
    local pid, fields = load_message(stream, redis.pcall('HGET', state, 'q' .. k))
    if not pid or not is_merge_part(fields, merge) or entry_ms(pid) > first_ms + merge.max
        or ending_of(sprefix, sid, k, msg_id_of(pid, fields), xc, xs) ~= '' then
      break
    end
    parts[#parts + 1] = {k, pid, fields}
    latest = math.max(latest, entry_ms(pid))
  end
  if #parts >= MAX_PARTS - 1 then return parts, 0 end
  return parts, math.min(latest + merge.window, first_ms + merge.max)
end

--[[
  Tenants: the message slots of a shard are shared between tenants by weighted fair queueing
  (start-time fair queueing over slot grants), work-conserving, with a guaranteed minimum and
  a maximum of sessions in flight per tenant. A message's tenant is its tenant field, else the
  group of DIALOG_TENANT_PATTERN in its session id (passed to the scripts as a Lua pattern,
  config.tenant_pattern_forms: the worker's Python computes the same), else 'default'; its
  priority (0-9, default 5) moves its session's place in its tenant's queue, PRIORITY_STEP_MS
  per level.

  Per shard, keys derived from the ready set's (its hash tag):
    <ready>:runq:<tenant>  zset  sessions of the tenant whose next message may start, waiting
                                 for a slot -> queue score (when queued, moved by priority)
    <ready>:active         zset  tenants with queued sessions -> virtual time (fair order)
    <ready>:vt             hash  tenant -> virtual time; field "\n": the shard's virtual clock
    <ready>:tset           hash  tenant -> "weight min max" (written by `tenants set`; none:
                                 weight 1, no minimum, no maximum)
    <ready>:tmin           zset  tenants with a guaranteed minimum (score: the minimum)
    <ready>:busy:<tenant>  zset  the tenant's sessions in flight -> lease end (ms): a crashed
                                 worker's session stops counting when its lease runs out
  and per session, in its state hash: Q (the tenant whose queue holds it), T (the tenant it
  counts in flight for, while its lock is held).

  A slot goes to the tenant under its minimum first, else to the active tenant with the
  smallest virtual time that is below its maximum; serving a tenant moves its virtual time on
  by 1 / weight from max(its own, the clock). A session that becomes runnable while a shard's
  queues are empty and a slot is free takes the slot at once (the single-tenant path costs
  what it did); otherwise it is queued and dispatch() hands out slots in fair order (intake,
  resume, and a commit whose session ends or gives its slot up).
]]
local DEFAULT_TENANT = 'default'
local MAX_TENANT_BYTES = 64
local PRIORITY_STEP_MS = 10000
-- A queued session is also in the ready set this far ahead: if it was somehow left out of its
-- queue, resume finds it then and queues it again.
local QUEUED_LOOK_MS = 60000
-- At most this many tenants are looked at for one slot (those at their maximum are passed).
local TENANT_SCAN = 64
local VCLOCK = '\n'

local function runq_key(ready, tenant) return ready .. ':runq:' .. tenant end
local function busy_key(ready, tenant) return ready .. ':busy:' .. tenant end
local function active_key(ready) return ready .. ':active' end
local function vt_key(ready) return ready .. ':vt' end
local function tset_key(ready) return ready .. ':tset' end
local function tmin_key(ready) return ready .. ':tmin' end

local function tenant_ok(name)
  return #name > 0 and #name <= MAX_TENANT_BYTES and not string.find(name, '[%z\1-\32\127]')
    and valid_utf8(name)
end

-- The tenant and priority of a message from its fields (the last of a repeated name).
local function tenant_of(fields, sid, pattern)
  local tenant, priority
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'tenant' then tenant = fields[i + 1]
    elseif fields[i] == 'priority' then priority = fields[i + 1] end
  end
  if not (tenant and tenant_ok(tenant)) then
    tenant = nil
    if pattern and pattern ~= '' then
      local ok, m = pcall(string.match, sid, pattern)
      if ok and type(m) == 'string' and tenant_ok(m) then tenant = m end
    end
  end
  local p = 5
  if priority and string.find(priority, '^%d$') then p = tonumber(priority) end
  return tenant or DEFAULT_TENANT, p
end

-- One call's view of the scheduling keys (cached reads, the tokens it hands out).
local function scheduler(ready, sprefix, stream, now, lock_ttl, token_base, pattern)
  return {ready = ready, sprefix = sprefix, stream = stream, now = now, ttl = lock_ttl,
          base = token_base, pattern = pattern, tokens = 0, conf = {}, busy = {}, receipt = {}}
end

local function tenant_conf(ctx, t)
  local c = ctx.conf[t]
  if not c then
    c = {w = 1, min = 0, max = 0}
    local v = redis.pcall('HGET', tset_key(ctx.ready), t)
    if type(v) == 'string' then
      local w, mn, mx = string.match(v, '^(%S+) (%d+) (%d+)$')
      c.w, c.min, c.max = tonumber(w) or 1, tonumber(mn) or 0, tonumber(mx) or 0
      if not (c.w > 0) then c.w = 1 end
    end
    ctx.conf[t] = c
  end
  return c
end

-- How many sessions of the tenant are in flight (leases that ran out are dropped first).
local function in_flight(ctx, t)
  local n = ctx.busy[t]
  if not n then
    local key = busy_key(ctx.ready, t)
    redis.pcall('ZREMRANGEBYSCORE', key, '-inf', ctx.now)
    n = tonumber(redis.pcall('ZCARD', key)) or 0
    ctx.busy[t] = n
  end
  return n
end

-- The session's lock was just taken for tenant t: it counts in flight (the caller writes the
-- state's T field). Leases that ran out are dropped only where a count is needed (in_flight:
-- a tenant with a minimum or a maximum), not at every lock taken.
local function busy_add(ctx, t, sid)
  if redis.pcall('ZADD', busy_key(ctx.ready, t), ctx.now + ctx.ttl, sid) == 1 and ctx.busy[t] then
    ctx.busy[t] = ctx.busy[t] + 1
  end
end

-- The session's lock is released (or deleted): it no longer counts in flight. tenant: its
-- state's T field (nil: it did not count). The caller deletes T (or the whole state).
local function busy_leave(ready, sid, tenant)
  if tenant then redis.pcall('ZREM', busy_key(ready, tenant), sid) end
end

-- Worker leases (lease-2.lua). A worker holds one lease per shard, a member of the sorted set
-- <ready>:workers (its number -> when the lease ends, ms), renewed once an interval whatever
-- the number of sessions it holds. The token of a lock taken under it carries the number
-- ("<consumer>:L<number>.<nonce>:<call>:<n>", the worker's token base then the call's
-- count; the consumer comes first, as in every token), and while the lock is held the session's place in
-- the ready set is HELD_BASE + that number: far past any clock, so no resume looks at it, and
-- exactly the worker's, so when the lease lapses the sessions it held are found in O(log n)
-- and brought back (sweep_worker). The token stays the fence of every write. A token without
-- that prefix (a lock taken before a worker had a lease) keeps the per-session lease: its
-- place is when its lock's TTL ends, renewed by renew-2.lua.
-- (1e13 ms is the year 2286; written as text, since Lua would print 1e13 + w as 1e+13.)
local HELD_BASE = 1e13

local function held_place(w)
  return string.format('%.0f', HELD_BASE + w)
end

local function workers_key(ready)
  return ready .. ':workers'
end

-- The worker number in a lock's token, or nil (not taken under a worker lease).
local function holder_of(token)
  if type(token) ~= 'string' then return nil end
  return tonumber(string.match(token, ':L(%d+)%.%x+:%d+:d?%d+$'))
end

-- The ready-set place of a session whose lock (token) was just taken or extended by ttl ms.
local function held_until(now, ttl, token)
  local w = holder_of(token)
  if w then return held_place(w) end
  return now + ttl
end

-- Whether worker w's lease is alive at now.
local function lease_alive(ready, w, now)
  local until_ms = tonumber(redis.pcall('ZSCORE', workers_key(ready), w))
  return until_ms ~= nil and until_ms >= now
end

-- Bring back up to `limit` sessions held under worker w's lapsed lease: a lock still carrying
-- its token is deleted (the holder is gone, or stalled: its late writes are fenced), the
-- session no longer counts in flight for its tenant, and it is due now in the ready set,
-- where a resume takes it up as it takes up any session whose lease ended. Returns how many.
local function sweep_worker(ready, sprefix, w, now, limit)
  local place = held_place(w)
  local sids = rcall('ZRANGEBYSCORE', ready, place, place, 'LIMIT', 0, limit)
  for _, sid in ipairs(sids) do
    local lock = session_key(sprefix, sid, 'lock')
    if holder_of(redis.pcall('GET', lock)) == w then
      rcall('DEL', lock)
      local state = session_key(sprefix, sid, 'state')
      local tenant = redis.pcall('HGET', state, 'T')
      if type(tenant) == 'string' then
        busy_leave(ready, sid, tenant)
        redis.pcall('HDEL', state, 'T')
      end
    end
    rcall('ZADD', ready, now, sid)
  end
  return #sids
end

local function vclock(ctx)
  if not ctx.v then ctx.v = tonumber(redis.pcall('HGET', vt_key(ctx.ready), VCLOCK)) or 0 end
  return ctx.v
end

-- Tenant t was given a slot (a dispatch, or a hand-off while others wait): its virtual time
-- moves on by 1 / weight from max(its own, the clock), and the clock to where it started.
local function serve(ctx, t, still_active)
  local vkey = vt_key(ctx.ready)
  local start = math.max(tonumber(redis.pcall('HGET', vkey, t)) or 0, vclock(ctx))
  local after = start + 1 / tenant_conf(ctx, t).w
  ctx.v = start
  rcall('HSET', vkey, t, after, VCLOCK, start)
  if still_active then rcall('ZADD', active_key(ctx.ready), after, t) end
end

-- Queue a session whose next message may start (fields: that message's) under its tenant, in
-- the order of `since` (ms: when its message was appended, so a tenant's queue keeps stream
-- order; now, for a session that gave its slot up: behind the others), moved by priority;
-- returns the tenant. A session already queued keeps its place.
local function enqueue(ctx, sid, fields, since)
  local t, prio = tenant_of(fields, sid, ctx.pattern)
  redis.pcall('ZADD', runq_key(ctx.ready, t), 'NX', since + (5 - prio) * PRIORITY_STEP_MS, sid)
  local akey = active_key(ctx.ready)
  if not rcall('ZSCORE', akey, t) then
    local vt = tonumber(redis.pcall('HGET', vt_key(ctx.ready), t)) or 0
    rcall('ZADD', akey, math.max(vt, vclock(ctx)), t)
  end
  rcall('ZADD', ctx.ready, ctx.now + QUEUED_LOOK_MS, sid)
  return t
end

-- The tenant to give the next slot to: one under its guaranteed minimum (the lowest virtual
-- time among them), else the active tenant with the lowest virtual time below its maximum.
-- Returns tenant, whether by its minimum, its virtual time, and whether it is the only
-- tenant with sessions waiting (then nobody's virtual time needs to move); nil when none may
-- have the slot.
-- The tenants with a guaranteed minimum (read once a call).
local function guaranteed(ctx)
  if ctx.guaranteed == nil then
    local g = redis.pcall('ZRANGE', tmin_key(ctx.ready), 0, TENANT_SCAN - 1)
    ctx.guaranteed = (type(g) == 'table' and not g['err']) and g or {}
  end
  return ctx.guaranteed
end

local function pick(ctx)
  local akey = active_key(ctx.ready)
  if ctx.prefer then  -- the tenant a yielding session gave its slot up to (should_yield)
    local u = ctx.prefer
    ctx.prefer = nil
    local score = tonumber(rcall('ZSCORE', akey, u))
    local mx = tenant_conf(ctx, u).max
    if score and (mx == 0 or in_flight(ctx, u) < mx) then return u, false, score, false end
  end
  local best, best_vt
  for _, t in ipairs(guaranteed(ctx)) do
    local score = tonumber(rcall('ZSCORE', akey, t))
    if score and (not best or score < best_vt) and in_flight(ctx, t) < tenant_conf(ctx, t).min then
      best, best_vt = t, score
    end
  end
  if best then return best, true, best_vt, false end
  local rows = rcall('ZRANGE', akey, 0, TENANT_SCAN - 1, 'WITHSCORES')
  for i = 1, #rows, 2 do
    local t = rows[i]
    local mx = tenant_conf(ctx, t).max
    if mx == 0 or in_flight(ctx, t) < mx then
      return t, false, tonumber(rows[i + 1]), #rows == 2
    end
  end
  return nil
end

-- Whether sessions of these tenants (tenant -> how many) can all take a slot now without
-- the queues: none waits in them and none would go past its tenant's maximum.
local function all_fit(ctx, wanted)
  if rcall('EXISTS', active_key(ctx.ready)) == 1 then return false end
  for t, n in pairs(wanted) do
    local mx = tenant_conf(ctx, t).max
    if mx > 0 and in_flight(ctx, t) + n > mx then return false end
  end
  return true
end

-- Take the lock of a queued session for tenant t and return its job row ({session_id, token,
-- seq, entry id, fields, state JSON, version, attempts, first_failed_at, last_error,
-- ending}), or nil when it cannot start now (nothing outstanding, held, its lock taken, its
-- next message missing: those are left to the ready set).
local function take(ctx, sid, t)
  local state = session_key(ctx.sprefix, sid, 'state')
  local h = redis.pcall('HMGET', state, 'a', 's', 'd', 'v', 'n', 'f', 'e', 'xc', 'xs', 'h', 'w')
  if h['err'] then return nil end
  local applied, last = tonumber(h[1]) or 0, tonumber(h[2]) or 0
  -- held, or waiting for a person (w: interrupt-3.lua; once resumed, resume-3.lua takes it up)
  if last <= applied or h[10] or h[11] then return nil end
  local seq = applied + 1
  local id, fields = load_message(ctx.stream, rcall('HGET', state, 'q' .. seq))
  if not id then
    rcall('ZADD', ctx.ready, ctx.now, sid)  -- missing: resume decides (a gap)
    return nil
  end
  local lock = session_key(ctx.sprefix, sid, 'lock')
  local token = ctx.base .. ':d' .. (ctx.tokens + 1)
  if not rcall('SET', lock, token, 'NX', 'PX', ctx.ttl) then
    rcall('ZADD', ctx.ready, held_until(ctx.now, math.max(rcall('PTTL', lock), 0),
                                        redis.pcall('GET', lock)), sid)
    return nil
  end
  ctx.tokens = ctx.tokens + 1
  local attempts = (tonumber(h[5]) or 0) + 1
  rcall('HSET', state, 'n', attempts, 'T', t)
  rcall('ZADD', ctx.ready, held_until(ctx.now, ctx.ttl, token), sid)
  busy_add(ctx, t, sid)
  local ending = ending_of(ctx.sprefix, sid, seq, msg_id_of(id, fields), h[8], h[9])
  ctx.receipt[#ctx.receipt + 1] = {'m', sid, token, seq, id, ending}
  local parts = {}
  if ending == '' and ctx.merge and ctx.merge.window > 0 and is_merge_part(fields, ctx.merge) then
    parts = merge_parts(ctx.stream, ctx.sprefix, sid, state, seq, id, last, h[8], h[9], ctx.merge)
  end
  return {sid, token, seq, id, fields, h[3] or '', h[4] or '0', attempts, h[6] or '',
          h[7] or '', ending, parts}
end

-- Up to n job rows from the shard's queues, in fair order. A tenant alone in the queues is
-- not served (its virtual time matters only against others'), and leaves the active set
-- when a pop finds its queue empty rather than after every pop.
local function dispatch(ctx, n)
  local rows, tries = {}, 0
  local akey = active_key(ctx.ready)
  while #rows < n and tries < 4 * n + 16 do
    tries = tries + 1
    local t, _, _, alone = pick(ctx)
    if not t then break end
    local rkey = runq_key(ctx.ready, t)
    local top = redis.pcall('ZPOPMIN', rkey)
    if top['err'] then top = {} end  -- a key of another type (written by hand): skipped
    local more = true
    if not top[1] or not alone then
      more = rcall('EXISTS', rkey) == 1
      if not more then rcall('ZREM', akey, t) end
    end
    local row = top[1] and take(ctx, top[1], t)
    if row then
      if not alone then serve(ctx, t, more) end
      rows[#rows + 1] = row
    end
  end
  return rows
end

-- Whether a session of tenant t, its next message ready and its lock ours, should give its
-- slot up: another tenant is owed it (under its minimum while t is not, or a virtual time no
-- later than t's: the tie goes to the tenant that waits), t is over its maximum (lowered
-- meanwhile), or, after a slow step (slow), other sessions of t wait. A slot t keeps while
-- others wait is a new grant (t is served); a slot it gives up goes to the tenant owed it
-- (ctx.prefer: the commit's dispatch gives it there even on a tie of virtual times), which
-- is charged, not t as well (charging both, the clock moved past the tenant owed the slot and
-- took its lead: weights 3:1 came out 2.3:1 with slow steps).
local function should_yield(ctx, t, slow)
  local first = rcall('ZRANGE', active_key(ctx.ready), 0, 1)
  if #first == 0 then return false end  -- nobody waits
  if first[1] == t and not first[2] and tenant_conf(ctx, t).max == 0 then
    return slow  -- only its own sessions wait: take turns after a slow step, nobody to charge
  end
  local conf = tenant_conf(ctx, t)
  local u, by_min, u_vt, alone = pick(ctx)
  local yield = conf.max > 0 and in_flight(ctx, t) > conf.max
  if not yield and u == t and alone then
    return slow  -- only its own sessions wait: take turns after a slow step, nobody to charge
  elseif yield or not u then
    -- decided: over its maximum, or nobody else may have the slot
  elseif u == t then
    yield = slow
  elseif by_min then
    yield = in_flight(ctx, t) > conf.min
  else
    local t_vt = math.max(tonumber(redis.pcall('HGET', vt_key(ctx.ready), t)) or 0, vclock(ctx))
    yield = u_vt <= t_vt
  end
  if not yield then
    serve(ctx, t, rcall('ZSCORE', active_key(ctx.ready), t) ~= false)
  elseif u and u ~= t then
    ctx.prefer = u  -- the slot goes to u even on a tie of virtual times (t queues behind)
  end
  return yield
end

-- The step journal and interrupts (journal-1.lua, interrupt-3.lua, resolve-2.lua).
-- A message's journal is a hash of its session, named by its msg_id (journal:<msg_id>),
-- written by the lease holder only:
--   o:<name>  the JSON result once(name, ...) recorded        b  bytes of those (names + values)
--   w         how many of its attempts ended awaiting (they are not counted as attempts)
-- Its commit deletes it (commit-5.lua), and so do reset and delete (erase-2.lua).
-- A message waiting for a person parks its session: the state hash's w holds its msg_id (a
-- marker the worker's scripts read with what they read anyway) and the session's await key
-- the interrupt (JSON: id, n, msg_id, seq, entry_id, payload as JSON text, at, timeout_at in
-- ms, 0 for none). Nothing hands a parked message out (resume-3.lua) until a resume (which
-- deletes the await key: resolve-2.lua, run by the application), its timeout (a member of
-- the shard's timer set, <session id>\n AWAIT_TIMER: fire-3.lua puts the session in the ready
-- set when due), or its cancel ends the wait. A parked session leaves the ready set and the
-- ages: it waits for a person, not for a worker.
-- How each interrupt ended is kept a day in a hash of the session (interrupts: id -> JSON
-- {"value": ...} | {"timeout": true} | {"ended": "cancelled"...}): the run after a resume
-- reads its answer there, and a second resume is told it came too late.
local AWAIT_TIMER = '\1await'
local INTERRUPTS_KEPT_S = 86400
local INTERRUPTS_KEPT = 256

local function journal_key(sprefix, sid, msg_id)
  return session_key(sprefix, sid, 'journal:' .. msg_id)
end

local function await_key(sprefix, sid)
  return session_key(sprefix, sid, 'await')
end

-- The resumers of idle workers block on this list (BLPOP) while the ready set is empty
-- (worker/dialog_worker/daemon/upkeep.py): an element wakes one of them, so a resumed
-- session is taken up at once rather than at their next look. At most one element waits.
-- pcall: a key of another type (written by hand) costs that speed only, never the caller's
-- call after its first writes.
local function kick(ready)
  redis.pcall('LPUSH', ready .. ':kick', 1)
  redis.pcall('LTRIM', ready .. ':kick', 0, 0)
end

-- The parked interrupt (the await key's JSON) as a table ({} when it cannot be read).
local function interrupt_record(value)
  local ok, rec = pcall(cjson.decode, value or '')
  if ok and type(rec) == 'table' then return rec end
  return {}
end

-- Record how an interrupt ended (a JSON text) for the run after it and for later resumes.
local function interrupt_ended(sprefix, sid, id, how)
  if type(id) ~= 'string' or id == '' then return end
  local key = session_key(sprefix, sid, 'interrupts')
  local n = redis.pcall('HLEN', key)
  if type(n) ~= 'number' then return end  -- a key of another type (written by hand)
  if n >= INTERRUPTS_KEPT then rcall('DEL', key) end  -- bounded: the oldest are forgotten
  rcall('HSET', key, id, how)
  rcall('EXPIRE', key, INTERRUPTS_KEPT_S)
end

-- The wait of a parked session is over without a resume (timed out, its message cancelled or
-- superseded): it is no longer parked, its timeout timer goes, and it is outstanding work
-- again (the ages). pcall: a shared key of another type (written by hand) must not fail the
-- caller's call after its first writes.
local function unpark(ready, sprefix, sid, rec, how)
  rcall('DEL', await_key(sprefix, sid))
  rcall('HDEL', session_key(sprefix, sid, 'state'), 'w')
  redis.pcall('ZREM', timers_key(ready), sid .. '\n' .. AWAIT_TIMER)
  redis.pcall('ZADD', ages_key(ready), entry_ms(tostring(rec['entry_id'] or '')), sid)
  interrupt_ended(sprefix, sid, rec['id'], how)
end


