--[[
  commit: the fenced writes of one or more finished messages (group commit: every commit that
  is ready when the previous call returns goes in one call), each independent of the others.
  Per commit: if the lock is still ours and the state is at the version we read, write the new
  state, append the reply event (and the dead letter, with the message's fields byte for byte
  and its seq, and a duplicate event for each copy of the message that arrived meanwhile),
  remove the message from the session's keys, then hand the lock on to the session's next
  message if one is waiting (return it with its fields; the session's age is now that
  message's), or release it and start the idle TTL (the session leaves the ages). A fenced
  commit writes nothing. A message that ends without being applied (a gap dead-lettered,
  cancelled, superseded) frees its msg_id: the dedupe key (and a cancel mark) is deleted, so
  a re-send is applied.

  Cancel against commit: an applied or dead-lettered commit of a message that has been
  cancelled meanwhile (its cancel mark exists, or an interrupting message set xc above its
  seq) writes nothing and is answered CANCELLED: the caller commits it as cancelled. The
  cancel script and this one are atomic, so each message gets exactly one outcome.

  Commits are isolated: one whose arguments cannot be used (a seq that is not a number, an
  outcome we do not know, dead-letter fields or reply extras that are not a JSON array of
  strings in pairs, reply extras naming a field every event carries, usage that is not what
  this header says) is answered
  INVALID and writes nothing; the others of the call are written. Only a call whose shape is
  wrong, or a shared key its writes touch of the wrong type, fails as a whole, before its first
  write (see the plan below).
  Per-session keys are read with pcall, so a corrupt one fences that commit alone. The state
  JSON is stored as given (no script parses it but intake, under pcall).

  KEYS[1] inbound stream   KEYS[2] ready set   KEYS[3] session key prefix
  KEYS[4] reply stream     KEYS[5] dead-letter stream

  ARGV[1] lock ttl (ms)   ARGV[2] state ttl (s)   ARGV[3] reply MAXLEN (0: none)
  ARGV[4] number of commits N, then N groups of 14:
    token, session_id, seq, expected version, state JSON, msg_id, reply, outcome
    ("applied" | "dead_lettered" | "cancelled" | "superseded" | "expired" |
    "budget_exceeded"), entry id (the
    message's entry; "" for a gap),
    dead-letter fields (JSON array of name/value pairs added after the original fields; ""
    for a normal commit), id of the session's next entry if the caller already has it (or ""),
    reply extras (JSON array of name/value pairs added to the message's reply events, its
    duplicates' too: rich replies, echoed fields; "" for none)
    timer operations the step asked for ("" for none: a JSON array of
    {"op": "set", "name", "text", "meta": [name, value, ...], "at_ms" | "delay_ms",
    "cancel_on_message"} and {"op": "cancel", "name"}, applied in order with the commit's
    writes; a set replaces a timer of the same name; see set_timer in _common.lua)
    model usage of the committed attempt ("" for none: a JSON object {"t": tenant, "d": UTC
    day yyyymmdd, "i": input tokens, "o": output tokens, "m": cost in millionths, "n":
    calls}, whole numbers >= 0): added to the tenant's counters of that day in the shard's
    usage hash (<ready set>:usage:<day>, fields <tenant>:in|out|cost|calls, kept 40 days) with
    the reply, so committed usage is counted exactly once
  After the groups, optionally: "hold" (a dead-lettered commit holds its session) or
  "continue", alone or followed by the scheduling values (the tenants in _common.lua):
    "1" | "0"     whether a commit that frees its slot fills it from the shard's queues
    token base    for the locks it takes so (unique per call)
    DIALOG_TENANT_PATTERN as a Lua pattern
    slow flags    one "1" | "0" per commit: its step took a while (the session takes turns
                  with its tenant's waiting sessions)
  With them, a commit that could hand its session on gives the slot up when another session is
  owed it (should_yield): the session joins its tenant's queue, behind; and a commit whose
  session releases its lock hands the slot to the session owed it in the same call.

  Held sessions (the state's h field, set here under "hold" or by an operator, hold-3.lua):
  a commit of a held session writes as usual but hands nothing on and leaves the ready set;
  its waiting messages stay until an operator releases or redrives it.

  The message's step journal (journal:<msg_id>, journal-1.lua) is deleted with its commit,
  whatever its outcome.

  A commit that already ran (same token and seq, recorded in the state's c field) is answered
  as it was the first time and writes nothing: a client that lost the reply may send it again.

  Returns one reply per commit:
    {6 COMMITTED, new version[, job]}            written; lock released (or left to resume);
        job: the session the freed slot went to (a job row as intake's)
    {2 HANDOFF, new version, next seq, next id, fields, ending}   written; the lock stays
        ours for the next message (fields {} when the caller said it already has that
        entry; ending: '' or 'cancelled' / 'superseded': it ends without a step)
    {-1 FENCED_TOKEN}    the lock is not ours any more: nothing written
    {-2 FENCED_VERSION}  the state moved on since we read it: nothing written
    {-3 INVALID, why}    this commit's arguments cannot be written (also: its timer
        operations would leave the session more than MAX_TIMERS timers): nothing written
    {-4 CANCELLED}       the message was cancelled meanwhile: nothing written
]]
local stream, ready, sprefix, replies, dlq = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lock_ttl, state_ttl, maxlen, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4])
local WIDTH = 15
if not (lock_ttl and state_ttl and maxlen and n) or n < 1
    or (#ARGV ~= 4 + n * WIDTH and #ARGV ~= 5 + n * WIDTH and #ARGV ~= 9 + n * WIDTH
        and #ARGV ~= 10 + n * WIDTH) then
  return redis.error_reply('ERR commit: bad arguments')
end
local tail = 4 + n * WIDTH  -- ARGV[tail + 1 ...]: the optional values after the groups
local hold_on_letter = #ARGV > tail and ARGV[tail + 1] == 'hold'
-- With the scheduling values: each commit that hands its session on checks the session is
-- not owed to another (should_yield), and each that frees its slot fills it from the shard's
-- queues when may_dispatch (dispatch in _common.lua).
local sched, may_dispatch, slow = nil, false, ''
if #ARGV >= tail + 5 then
  sched = scheduler(ready, sprefix, stream, 0, lock_ttl, ARGV[tail + 3], ARGV[tail + 4])
  may_dispatch, slow = ARGV[tail + 2] == '1', ARGV[tail + 5]
end
-- Merged bursts (merge_parts in _common.lua): a hand-off to the first of a burst to merge
-- waits for its window, and hands its parts on with it.
local merge = merge_spec(ARGV[tail + 6])
if sched then sched.merge = merge end
local inbound, ages = inbound_key(ready), ages_key(ready)

local OUTCOMES = {applied = true, dead_lettered = true, cancelled = true, superseded = true,
                  expired = true}
OUTCOMES.budget_exceeded = true  -- over its tenant's (or session's) token budget: no step
local USAGE_KEEP_S = 40 * 86400
local MAX_COUNT = 1e15
-- Reply extras may not replace the fields every event carries.
local EVENT_FIELDS = {session_id = true, msg_id = true, seq = true, outcome = true, reply = true,
                      produced_at = true, entry_id = true}

-- A JSON array of at most 64 strings, in name/value pairs, or nil.
local function pairs_of(json)
  local ok, list = pcall(cjson.decode, json)
  if not ok or type(list) ~= 'table' or #list % 2 ~= 0 or #list > 64 then return nil end
  for _, v in ipairs(list) do
    if type(v) ~= 'string' then return nil end
  end
  return list
end

-- A commit's usage argument decoded, or nil when it is not what the header says.
local function usage_of(json)
  local ok, u = pcall(cjson.decode, json)
  if not ok or type(u) ~= 'table' or type(u['t']) ~= 'string' or #u['t'] < 1 or #u['t'] > 64
      or type(u['d']) ~= 'string' or not string.find(u['d'], '^%d%d%d%d%d%d%d%d$') then
    return nil
  end
  for _, name in ipairs({'i', 'o', 'm', 'n'}) do
    local v = u[name]
    if type(v) ~= 'number' or v < 0 or v > MAX_COUNT or math.floor(v) ~= v then return nil end
  end
  return u
end

-- Why a commit's arguments cannot be written, or nil (then c.extra holds its letter fields,
-- c.event its reply extras, c.usage its usage).
local function invalid(c, extra_json, event_json, usage_json)
  if not (c.seq and c.version and c.seq >= 1) then return 'seq or version is not a number' end
  if not OUTCOMES[c.outcome] then return 'unknown outcome' end
  if extra_json ~= '' then
    c.extra = pairs_of(extra_json)
    if not c.extra then return 'bad dead-letter fields' end
  end
  if event_json ~= '' then
    c.event = pairs_of(event_json)
    if not c.event then return 'bad reply extras' end
    for i = 1, #c.event, 2 do
      if EVENT_FIELDS[c.event[i]] then return 'bad reply extras' end
    end
  end
  if usage_json ~= '' then
    c.usage = usage_of(usage_json)
    if not c.usage then return 'bad usage' end
  end
  return nil
end

-- The timer operations of a commit, decoded and checked, or nil and why not.
local function timer_ops(json)
  local ok, ops = pcall(cjson.decode, json)
  if not ok or type(ops) ~= 'table' or #ops > 2 * MAX_TIMERS then
    return nil, 'bad timer operations'
  end
  for _, op in ipairs(ops) do
    if type(op) ~= 'table' then return nil, 'bad timer operations' end
    local problem = timer_problem(op['name'])
    if problem then return nil, problem end
    if op['op'] == 'set' then
      local at, delay = op['at_ms'], op['delay_ms']
      if not ((type(at) == 'number' and at >= 0) or (type(delay) == 'number' and delay >= 0))
          or type(op['text']) ~= 'string' or not string.find(op['text'], '%S')
          or type(op['meta']) ~= 'table' or #op['meta'] % 2 ~= 0 or #op['meta'] > 60 then
        return nil, 'bad timer ' .. op['name']
      end
      for _, v in ipairs(op['meta']) do
        if type(v) ~= 'string' then return nil, 'bad timer ' .. op['name'] end
      end
    elseif op['op'] ~= 'cancel' then
      return nil, 'bad timer operations'
    end
  end
  return ops
end

-- Whether the timer operations would leave the session more than MAX_TIMERS timers.
local function too_many_timers(c)
  local tkey = session_key(sprefix, c.sid, 'timers')
  local tk = redis.pcall('TYPE', tkey)
  if type(tk) ~= 'table' or (tk['ok'] ~= 'none' and tk['ok'] ~= 'hash') then return true end
  local n, present = timer_count(tkey), {}
  for _, op in ipairs(c.timers) do
    local name = op['name']
    if present[name] == nil then present[name] = rcall('HEXISTS', tkey, 't:' .. name) == 1 end
    if op['op'] == 'set' and not present[name] then n, present[name] = n + 1, true
    elseif op['op'] == 'cancel' and present[name] then n, present[name] = n - 1, false end
    if n > MAX_TIMERS then return true end
  end
  return false
end

-- Returns whether it set a timer that a user message cancels.
local function apply_timers(c, now)
  local on_message = false
  for _, op in ipairs(c.timers) do
    if op['op'] == 'cancel' then
      drop_timer(ready, sprefix, c.sid, op['name'])
    else
      local due = op['at_ms'] or (now + op['delay_ms'])
      due = math.floor(due)
      local fields = {'session_id', c.sid, 'text', op['text'],
                      'msg_id', 'timer:' .. op['name'] .. ':' .. due, 'timer', op['name']}
      for _, v in ipairs(op['meta']) do fields[#fields + 1] = v end
      set_timer(ready, sprefix, c.sid, op['name'], due, op['cancel_on_message'] == true, fields)
      on_message = on_message or op['cancel_on_message'] == true
    end
  end
  return on_message
end

-- Validate every commit before any write.
local commits = {}
for i = 0, n - 1 do
  local b = 4 + i * WIDTH
  local c = {token = ARGV[b + 1], sid = ARGV[b + 2], seq = tonumber(ARGV[b + 3]),
             version = tonumber(ARGV[b + 4]), doc = ARGV[b + 5], msg_id = ARGV[b + 6],
             reply = ARGV[b + 7], outcome = ARGV[b + 8], entry_id = ARGV[b + 9],
             known_next = ARGV[b + 11]}
  c.problem = invalid(c, ARGV[b + 10], ARGV[b + 12], ARGV[b + 14])
  if not c.problem and ARGV[b + 15] ~= '' then
    -- A merged step: its parts are seqs first..seq (seq: the last, whose message answers).
    c.first = tonumber(ARGV[b + 15])
    if not (c.first and c.first >= 1 and c.first < c.seq and c.seq - c.first < MAX_PARTS) then
      c.problem = 'bad first part of a merged step'
    end
  end
  c.first = c.first or c.seq
  if not c.problem and ARGV[b + 13] ~= '' then
    c.timers, c.problem = timer_ops(ARGV[b + 13])
  end
  commits[#commits + 1] = c
end

local now = now_ms()
local results, dels = {}, {}

-- The session's next message, as the commit answers it: {next seq, id, fields} (fields {}
-- when the caller has them), or nil when it is missing.
local function next_message(c, value, xc, xs)
  local id, fields = load_message(stream, value)
  if not id then return nil end
  local ending = ending_of(sprefix, c.sid, c.seq + 1, msg_id_of(id, fields), xc, xs)
  return {c.seq + 1, id, id == c.known_next and {} or fields, ending, fields}
end

-- A commit's reads: its lock's holder and what it needs of its state (once per commit).
local function read(c)
  c.read = true
  c.state = session_key(sprefix, c.sid, 'state')
  c.lock = session_key(sprefix, c.sid, 'lock')
  c.holder = redis.pcall('GET', c.lock)
  c.h = redis.pcall('HMGET', c.state, 'v', 'a', 's', 'q' .. ((c.seq or 0) + 1),
                    'u' .. (c.seq or 0), 'c', 'q' .. (c.seq or 0), 'xc', 'xs', 'h', 'T', 'w')
end

-- The earlier parts of a merged step: {seq, entry id, fields, msg_id} each (custody), read
-- once.
local function earlier_parts(c)
  if not c.parts then
    c.parts = {}
    for k = c.first, c.seq - 1 do
      local id, fields = load_message(stream, redis.pcall('HGET', c.state, 'q' .. k))
      c.parts[#c.parts + 1] = {k, id or '', fields or {}, id and msg_id_of(id, fields) or ''}
    end
  end
  return c.parts
end

-- Whether an earlier part of a merged step was cancelled meanwhile (the whole step then
-- ends cancelled, as for its last part).
local function part_cancelled(c, xc)
  for _, part in ipairs(earlier_parts(c)) do
    if part[4] ~= '' and ending_of(sprefix, c.sid, part[1], part[4], xc) == 'cancelled' then
      return true
    end
  end
  return false
end

-- The reply of a commit that writes nothing, or nil when it is to be written. Reads only.
local function decide(c)
  local holder, h = c.holder, c.h
  local done = c.seq and type(h) == 'table' and not h['err'] and h[6] == c.token .. ':' .. c.seq
  if c.problem then
    return {-3, c.problem}
  elseif done and (tonumber(h[1]) or 0) == c.version + 1 then
    -- This very commit already ran (a client re-sent the call after losing the reply):
    -- answer as it did, writing nothing more.
    local nxt = holder == c.token and (tonumber(h[3]) or 0) > c.seq
      and next_message(c, h[4], h[8], h[9])
    if nxt then
      return {2, c.version + 1, nxt[1], nxt[2], nxt[3], nxt[4], {}}
    end
    return {6, c.version + 1}
  elseif holder ~= c.token then
    return {-1}
  elseif type(h) ~= 'table' or h['err'] or (tonumber(h[1]) or 0) ~= c.version
      or (tonumber(h[2]) or 0) ~= c.first - 1 or (tonumber(h[3]) or 0) < c.seq then
    return {-2}
  elseif (c.outcome == 'applied' or c.outcome == 'dead_lettered') and h[7] and c.msg_id ~= ''
      and (ending_of(sprefix, c.sid, c.seq, c.msg_id, h[8]) == 'cancelled'
           or part_cancelled(c, h[8])) then
    return {-4}
  elseif c.timers and too_many_timers(c) then
    return {-3, 'the session would have more than ' .. MAX_TIMERS .. ' timers'}
  end
  return nil
end

-- The writes for the earlier parts of a merged step (c.first .. c.seq - 1), each as its own
-- message: applied with the last part, a part's reply event says `merged` and which msg_id
-- answered it (`answered_by`), with the same reply; ended otherwise, it ends the same way
-- (a dead letter of its own, its msg_id freed as for any message that ended unapplied).
-- Its copies are answered, and its custody goes. The history has one turn, the last part's.
local UNAPPLIED = {expired = true, budget_exceeded = true, cancelled = true, superseded = true}

local function write_earlier_parts(c, now)
  local outcome = c.outcome == 'applied' and 'merged' or c.outcome
  local extra = {}
  for _, v in ipairs(c.event or {}) do extra[#extra + 1] = v end
  if outcome == 'merged' then
    extra[#extra + 1] = 'answered_by'
    extra[#extra + 1] = c.msg_id
  end
  for _, part in ipairs(earlier_parts(c)) do
    local k, pid, fields, mid = part[1], part[2], part[3], part[4]
    if c.extra then
      local letter = letter_fields(fields)
      for _, v in ipairs(c.extra) do letter[#letter + 1] = v end
      for _, v in ipairs({'seq', k, 'source_stream', stream, 'source_entry_id', pid}) do
        letter[#letter + 1] = v
      end
      rcall('XADD', dlq, '*', unpack(letter))
      index_letter(ready, sprefix, c.sid, rcall('XREVRANGE', dlq, '+', '-', 'COUNT', 1)[1][1])
    end
    if mid ~= '' and UNAPPLIED[outcome] then
      local dkey = session_key(sprefix, c.sid, 'msg:' .. mid)
      if redis.pcall('GET', dkey) == tostring(k) then rcall('DEL', dkey) end
      rcall('DEL', cancel_key(sprefix, c.sid, mid))
    end
    reply_event(replies, maxlen, c.sid, mid, k, outcome, c.reply, now, pid, extra)
    local copies = redis.pcall('HGET', c.state, 'u' .. k)
    if type(copies) == 'string' then
      for copy in string.gmatch(copies, '[^,]+') do
        reply_event(replies, maxlen, c.sid, mid, k, 'duplicate', c.reply, now, copy, extra)
      end
    end
    if mid ~= '' then rcall('DEL', journal_key(sprefix, c.sid, mid)) end
    rcall('HDEL', c.state, 'q' .. k, 'u' .. k)
  end
end

-- Plan before the first write: every commit's reads and what it does, then the shared keys
-- the writes will touch are checked (expect_type in _common.lua), and only those: a call
-- whose commits are all fenced writes nothing and checks nothing. A commit that writes adds
-- its reply event and moves its session in the ready set and the ages; a dead letter, timers,
-- and a message stored before custody (an entry id, still in the stream: read and deleted
-- there, and the inbound hash's length follows) or copies of it add their keys. A session
-- named twice in one call (the worker never sends that) reads its second commit after the
-- first one's writes, so such a call checks every shared key.
local function before_custody(value)
  return value and string.find(value, '^%d+%-%d+$') ~= nil
end
local named, again = {}, false
for _, c in ipairs(commits) do
  if named[c.sid] then
    again = true
  else
    named[c.sid] = true
    read(c)
    c.result = decide(c)
  end
end
local touch = {}
for _, c in ipairs(commits) do
  if again or (c.read and not c.result) then
    local h = c.h or {}
    touch.writes = true
    touch.dlq = touch.dlq or again or c.extra ~= nil
    touch.timers = touch.timers or again or c.timers ~= nil
    if c.usage then
      touch.usage = touch.usage or {}
      touch.usage[c.usage['d']] = true
    end
    touch.stream = touch.stream or again or before_custody(h[7]) or before_custody(h[4])
      or not not h[5]
  end
end
if touch.writes then
  local streams, sets = {replies}, {{ready, 'zset'}, {ages, 'zset'}}
  if touch.dlq then streams[#streams + 1] = dlq end
  if touch.stream then
    streams[#streams + 1] = stream
    sets[#sets + 1] = {inbound, 'hash'}
  end
  if touch.timers then sets[#sets + 1] = {timers_key(ready), 'zset'} end
  if sched then
    sets[#sets + 1] = {active_key(ready), 'zset'}
    sets[#sets + 1] = {vt_key(ready), 'hash'}
  end
  for day in pairs(touch.usage or {}) do sets[#sets + 1] = {ready .. ':usage:' .. day, 'hash'} end
  local err = expect_streams(streams) or expect_types(sets)
  if err then return err end
end

for ci, c in ipairs(commits) do
  if not c.read then
    read(c)
    c.result = decide(c)
  end
  local state, lock, h = c.state, c.lock, c.h
  if c.result then
    results[#results + 1] = c.result
  else
    local version, last = c.version + 1, tonumber(h[3]) or 0
    local id, fields, legacy = load_message(stream, h[7])
    -- A merged step's earlier parts first: their events and letters in the parts' order.
    if c.first < c.seq then write_earlier_parts(c, now) end
    if c.extra then
      local letter = fields and letter_fields(fields) or {'session_id', c.sid}
      for _, v in ipairs(c.extra) do letter[#letter + 1] = v end
      for _, v in ipairs({'seq', c.seq, 'source_stream', stream, 'source_entry_id', c.entry_id}) do
        letter[#letter + 1] = v
      end
      rcall('XADD', dlq, '*', unpack(letter))
      index_letter(ready, sprefix, c.sid, rcall('XREVRANGE', dlq, '+', '-', 'COUNT', 1)[1][1])
    end
    if c.msg_id ~= '' and ((not id and c.outcome == 'dead_lettered') or c.outcome == 'expired'
        or c.outcome == 'budget_exceeded'
        or c.outcome == 'cancelled' or c.outcome == 'superseded') then
      -- A gap, or a message that was cancelled, superseded, expired or over its budget: it
      -- ended without being applied, so its msg_id may be sent again.
      local dkey = session_key(sprefix, c.sid, 'msg:' .. c.msg_id)
      if redis.pcall('GET', dkey) == tostring(c.seq) then rcall('DEL', dkey) end
      rcall('DEL', cancel_key(sprefix, c.sid, c.msg_id))
    end
    reply_event(replies, maxlen, c.sid, c.msg_id, c.seq, c.outcome, c.reply, now, c.entry_id,
                c.event)
    if c.usage then
      local u = c.usage
      local ukey = ready .. ':usage:' .. u['d']
      rcall('HINCRBY', ukey, u['t'] .. ':in', u['i'])
      rcall('HINCRBY', ukey, u['t'] .. ':out', u['o'])
      rcall('HINCRBY', ukey, u['t'] .. ':cost', u['m'])
      rcall('HINCRBY', ukey, u['t'] .. ':calls', u['n'])
      rcall('EXPIRE', ukey, USAGE_KEEP_S)
    end
    local forget = {}  -- state fields that go besides the message's own
    if c.timers and apply_timers(c, now) then
      forget[1] = 'tc'  -- the next user message must look at the timers (cancel_message_timers)
    end
    if legacy then dels[#dels + 1] = id end  -- sequenced before custody: still in the stream
    if h[5] then
      -- Copies of this message that arrived while it was outstanding: answered now (their
      -- entries left the stream at intake; a copy read before custody is deleted now).
      for copy in string.gmatch(h[5], '[^,]+') do
        reply_event(replies, maxlen, c.sid, c.msg_id, c.seq, 'duplicate', c.reply, now, copy,
                    c.event)
        dels[#dels + 1] = copy
      end
    end
    rcall('HDEL', state, 'q' .. c.seq, 'u' .. c.seq, 'f', 'e', 'g', unpack(forget))
    if c.msg_id ~= '' then
      -- The message's step journal (journal-1.lua) ends with it; so does a wait of it that
      -- something ended without a resume (interrupt-3.lua).
      rcall('DEL', journal_key(sprefix, c.sid, c.msg_id))
      if h[12] == c.msg_id then
        rcall('HDEL', state, 'w')
        rcall('DEL', await_key(sprefix, c.sid))
      end
    end

    local held = h[10] or (hold_on_letter and c.outcome == 'dead_lettered')
    if held and not h[10] then
      rcall('HSET', state, 'h', 'dead letter at ' .. now .. ' (seq ' .. c.seq .. ')')
    end
    local nxt = last > c.seq and next_message(c, h[4], h[8], h[9])
    if held then nxt = nil end  -- held: nothing is handed on
    local window_closes
    if nxt and nxt[4] == '' and merge.window > 0 and is_merge_part(nxt[5], merge) then
      local parts, close = merge_parts(stream, sprefix, c.sid, state, nxt[1], nxt[2], last,
                                       h[8], h[9], merge)
      if close > now then
        nxt, window_closes = nil, close  -- its window is open: resume hands it out then
      else
        nxt[6] = parts
      end
    end
    local tenant, queued = h[11], false
    if nxt and sched then
      -- The next message's tenant counts it in flight from now (the same one, but for a
      -- producer that names another); it keeps the slot unless another is owed it.
      sched.now = now
      local t = tenant_of(nxt[5], c.sid, sched.pattern)
      if t ~= tenant then
        busy_leave(ready, c.sid, tenant)
        busy_add(sched, t, c.sid)
        tenant = t
      end
      if should_yield(sched, t, string.sub(slow, ci, ci) == '1') then
        nxt, queued = nil, nxt
      end
    end
    if nxt then
      -- Hand-off: the lock stays ours for the next message; its start is counted now.
      rcall('HSET', state, 'd', c.doc, 'v', version, 'a', c.seq, 'n', 1, 'c', c.token .. ':' .. c.seq)
      if tenant ~= h[11] then rcall('HSET', state, 'T', tenant) end
      rcall('PEXPIRE', lock, lock_ttl)
      rcall('ZADD', ready, held_until(now, lock_ttl, c.token), c.sid)
      rcall('ZADD', ages, entry_ms(nxt[2]), c.sid)
      results[#results + 1] = {2, version, nxt[1], nxt[2], nxt[3], nxt[4], nxt[6] or {}}
    else
      rcall('HSET', state, 'd', c.doc, 'v', version, 'a', c.seq, 'n', 0, 'c', c.token .. ':' .. c.seq)
      rcall('DEL', lock)
      busy_leave(ready, c.sid, tenant)
      if tenant then rcall('HDEL', state, 'T') end
      if queued then
        -- Its slot is owed elsewhere: it waits in its tenant's queue, its age kept.
        enqueue(sched, c.sid, queued[5], behind_at(now))
      elseif last > c.seq and held then
        rcall('ZREM', ready, c.sid)  -- held: waits for a release or redrive (hold-3.lua)
      elseif window_closes then
        rcall('ZADD', ready, window_closes, c.sid)  -- a burst to merge: taken up when it closes
      elseif last > c.seq then
        rcall('ZADD', ready, now, c.sid)  -- the next message is missing: resume decides (gap)
      else
        rcall('ZREM', ready, c.sid)
        rcall('ZREM', ages, c.sid)
        -- nothing is left below them (read above: most sessions never had them)
        if h[8] or h[9] then rcall('HDEL', state, 'xc', 'xs') end
        rcall('EXPIRE', state, state_ttl)
      end
      local row = nil
      if may_dispatch and rcall('EXISTS', active_key(ready)) == 1 then
        -- The slot this commit frees goes to the session owed it, in this same call.
        sched.now = now
        row = dispatch(sched, 1)[1]
      end
      results[#results + 1] = row and {6, version, row} or {6, version}
    end
    if sched then sched.prefer = nil end  -- a yield's choice is for its own slot only
  end
end

-- Entries read before custody (and their copies) leave the stream now; the inbound hash's
-- length follows, so intake does not count them as trimmed.
local deleted = 0
for i = 1, #dels, 1000 do
  deleted = deleted + rcall('XDEL', stream, unpack(dels, i, math.min(i + 999, #dels)))
end
if deleted > 0 and rcall('HGET', inbound, 'length') then
  redis.pcall('HINCRBY', inbound, 'length', -deleted)
end
return results
