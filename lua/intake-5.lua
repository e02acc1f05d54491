--[[
  intake: deliver new entries of the inbound stream to this worker and give each its
  per-session seq, in stream order, in the same atomic step. Producers append plain entries
  (XADD <stream> * session_id <id> text <text> [msg_id <id>] [fields]); everything an entry
  says is untrusted, so it is checked here before it can touch any session.

  Per entry, in stream order:
    refused   (no usable session_id or msg_id, missing/blank text, too many fields, too
              large, a repeated field name): dead-lettered alone (malformed) with its raw
              fields; a dead_lettered reply event (seq 0) when it names a valid session.
    duplicate (msg_id seen inside the dedupe window): one duplicate reply event with the
              original seq and its reply. If the original is still outstanding, the copy
              waits (indexed as u<seq>) and the original's commit answers it, right after
              the original's own event; otherwise it is answered now (with the reply while
              it is in the session's history) and removed.
    sequenced seq = last seq + 1; the message (entry id and fields, byte for byte) moves into
              its session's state hash (q<seq>, see pack_message in _common.lua), which is
              made persistent while anything is outstanding. If it is the session's next
              message and the lock is free, the lock is taken (one token per session) and
              the job returned. Otherwise it waits there: the lock holder's commit hands it
              on, or the ready set brings it back (resume-3.lua). Its msg_id (else its entry
              id) is indexed for the console: msg_id -> session_id in a hash of the quarter
              (find_quarter in _common.lua), one HSET per call. A held session (the state's
              h field, hold-3.lua) takes no lock and stays out of the ready set: its
              messages wait until an operator releases or redrives it.
  Double-texting: when the session already has a message outstanding, the entry's multitask
  field (else ARGV[15]) decides: enqueue (sequenced as above), reject (one rejected reply
  event, seq 0, and, with ARGV[19], an end entry in its partial stream for readers that did
  not see the event, mark_rejected below; its msg_id stays free), interrupt (sequenced; every message
  outstanding before it ends cancelled in its turn: xc = its seq, and the running one gets a
  cancel mark so its worker stops the step), coalesce (sequenced; every message before it
  that is not running yet ends superseded in its turn: xs = its seq). Either ends the wait of
  a message parked on an interrupt (interrupt-3.lua) at once: the session is due now. A multitask value
  other than these four makes the entry malformed.
  Timers: an entry with a deliver_at field (unix seconds) in the future is not
  sequenced now: it becomes a timer of its session (see defer below and fire-3.lua). A
  sequenced entry without a timer field (a user's message) cancels its session's timers that
  were set with cancel_on_message. Each sequenced message's msg_id goes into its session's
  msg_id index (index_msg_ids in _common.lua), which delete uses instead of a scan.
  Every delivered entry is acked and deleted from the stream in this call (custody): the
  stream holds only unread entries, so no producer command (XADD MAXLEN/MINID, XTRIM, XDEL)
  can touch a sequenced message, and nothing ever waits in a pending list: a crashed
  worker's sessions come back through the ready set when their lock lease ends.

  Unread entries removed by anything else are counted: the stream's entries-added and length
  as this call leaves them are kept in the inbound hash (inbound_key in _common.lua); the next
  call expects length + (entries added since), and what is missing was trimmed or deleted by
  hand. A last id far ahead of the clock (an explicit id, after which XADD * can fail) is
  recorded there too. Both O(1): one XINFO STREAM per call.
  Sent twice with the same token base (a lost reply), the call returns the first call's jobs
  again (see the receipts in _common.lua); their later entries come through hand-off.

  KEYS[1] inbound stream   KEYS[2] ready set (zset: session id -> ms when to look at it)
  KEYS[3] session key prefix ("<prefix>:{<tag>}:s:")   KEYS[4] dead-letter stream
  KEYS[5] reply stream

  ARGV[1] group   ARGV[2] consumer   ARGV[3] most entries to read (1..1000)
  ARGV[4] token base (unique per call)   ARGV[5] lock ttl (ms)   ARGV[6] dedupe ttl (s)
  ARGV[7] max entry bytes   ARGV[8] max extra fields   ARGV[9] reply MAXLEN (0: none)
  ARGV[10] worker version   ARGV[11] claim idle (ms): > 0 takes over entries left pending
           that long (never sequenced: delivery and sequencing are one step) instead of
           reading new ones   ARGV[12] fallback reply
  ARGV[13] this stream's shard index   ARGV[14] shard count (both optional; a count above 1
           refuses an entry whose session belongs to another shard: crc32 of its UTF-8 id
           mod the count, as keys.shard_of; it would get a second state here)
  ARGV[15] default multitask policy (enqueue | reject | interrupt | coalesce; optional)
  ARGV[16] echoed fields: names, comma-separated, of the entry's fields copied onto the reply
           events this call writes for it (optional; the commit's events get them from the
           worker)
  ARGV[17] free slots: most sessions this call may hand out (optional; default ARGV[3])
  ARGV[18] DIALOG_TENANT_PATTERN as a Lua pattern ("" or absent: none)
  ARGV[19] partial stream ttl (s): how long a rejected message's end is kept (optional; absent
           or 0: none is written)
  ARGV[21] look again (ms): when a session with work outstanding and no place in the ready set
           (parked, held, or its place lost) is looked at (optional; default ARGV[5]: under a
           worker lease, ARGV[5] is the long lock TTL and this the lease's); also how long the
           call's receipt is kept

  Slots and tenants (see the tenants in _common.lua): the sessions whose next message arrived
  in this call and may start (lock free, not held) take their locks at once, in stream order,
  when the shard's queues are empty and there are free slots for all of them within their
  tenants' maxima; otherwise each joins its tenant's queue, and the free slots go out in fair
  order (dispatch). A call with no free slot still reads: what it reads is sequenced and
  queued, so the next slot freed anywhere goes to the session owed it. A session of a named
  tenant (not the default) marks the shard (<ready>:named, NAMED_KEEP_S): tenants are in use,
  and the workers' readers read ahead while their slots are full.

  Returns {last id, entries read, jobs, held,
           {duplicates, refused, contended, trimmed, ahead, rejected, waiting}}
    waiting  1 when sessions of the shard still wait in its queues after this call
    trimmed  unread entries that vanished from the stream since the last intake call
    ahead    1 when this call found the stream's last id pushed ahead of the clock (once)
    last id  the id of the last entry read, or, when none was read, the group's
             last-delivered id (block on XREAD from there: nothing appended meanwhile is missed)
    jobs     {session_id, token, seq, entry id, fields, state JSON, version, attempts,
              first_failed_at, last_error, ending} per session whose lock this call took;
             ending: '' (run the step), or 'cancelled' / 'superseded' (end it without one)
    held     {session_id, seq, entry id, fields}: later entries of those sessions, read in
             this call, which the job's commits will hand on
]]
local stream, ready, sprefix, dlq, replies = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local group, consumer, token_base, fallback = ARGV[1], ARGV[2], ARGV[4], ARGV[12]
local count, lock_ttl, dedupe_ttl = tonumber(ARGV[3]), tonumber(ARGV[5]), tonumber(ARGV[6])
local max_bytes, max_extra = tonumber(ARGV[7]), tonumber(ARGV[8])
local maxlen, claim_idle = tonumber(ARGV[9]), tonumber(ARGV[11])
local shard, shards = tonumber(ARGV[13] or '0'), tonumber(ARGV[14] or '1')
local POLICIES = {enqueue = true, reject = true, interrupt = true, coalesce = true,
                  merge = true}
local default_policy = ARGV[15] or 'enqueue'
local ECHO = {}
for name in string.gmatch(ARGV[16] or '', '[^,]+') do ECHO[name] = true end
local free_slots = tonumber(ARGV[17] or ARGV[3])
local tenant_pattern = ARGV[18] or ''
local partial_ttl = tonumber(ARGV[19] or '0')
local merge = merge_spec(ARGV[20] or ((ARGV[15] or 'enqueue') .. ',0,0'))
local look_again = tonumber(ARGV[21] or ARGV[5])

if not (count and lock_ttl and dedupe_ttl and max_bytes and max_extra and maxlen and claim_idle
        and shard and shards and partial_ttl and look_again) or count < 1 or count > 1000 or shards < 1
    or not POLICIES[default_policy] or not free_slots or free_slots < 0 then
  return redis.error_reply('ERR intake: bad arguments')
end
-- The shared keys' types, before the first write (expect_type in _common.lua), each as
-- cheaply as it allows: the stream by the trim detection's XINFO STREAM and the inbound hash
-- by its HMGET (both read here, written after the read); the others only when there is an
-- entry to read (every entry read leaves the stream in the same call, so an empty stream
-- means a call that writes none of them): the dead-letter and reply streams in one XREAD,
-- the sorted sets (ready, ages, timers: deliver_at, cancel_on_message) by TYPE.
local inbound = inbound_key(ready)
local info = redis.pcall('XINFO', 'STREAM', stream)
if info['err'] then
  local err = expect_type(stream, 'stream')  -- else no such key, or an ACL without XINFO
  if err then return err end
end
local before = redis.pcall('HMGET', inbound, 'added', 'length', 'ahead', 'error')
if before['err'] then
  local err = expect_type(inbound, 'hash')
  if err then return err end
end
local stream_info = {}
if not info['err'] then
  for i = 1, #info, 2 do stream_info[info[i]] = info[i + 1] end
end
if info['err'] or (tonumber(stream_info['length']) or 1) > 0 then
  local err = expect_streams({dlq, replies}) or expect_types({{ready, 'zset'},
    {ages_key(ready), 'zset'}, {timers_key(ready), 'zset'}, {active_key(ready), 'zset'},
    {vt_key(ready), 'hash'}})
  if err then return err end
end

local MAX_ID_BYTES = 256
-- Copies of a not-yet-applied message waiting for its commit (ids joined by commas, at most
-- this many bytes, about 40 copies); more are answered at once: a producer repeating one
-- msg_id must not grow a session's hash without bound.
local MAX_WAITING_COPIES_BYTES = 1024
-- A last id this far ahead of the server clock was not made by XADD *: an explicit id pushed
-- it there (a clock step back of the Redis host stays well below it).
local AHEAD_MS = 3600 * 1000
-- How long a shard counts as having tenants in use after an entry last named one.
local NAMED_KEEP_S = 86400

-- nil when the id is usable, else why not.
local function id_problem(kind, value)
  if value == nil then return kind .. ' is missing' end
  if #value == 0 then return kind .. ' is empty' end
  if #value > MAX_ID_BYTES then
    return kind .. ' is ' .. #value .. ' bytes; at most ' .. MAX_ID_BYTES .. ' are allowed'
  end
  if string.find(value, '%c') then return kind .. ' contains control characters' end
  if not string.find(value, '%S') then return kind .. ' is blank' end
  if not valid_utf8(value) then return kind .. ' is not valid UTF-8' end
  return nil
end

-- Returns problem (or nil), session_id (only when valid), msg_id (or nil). An entry names a
-- session when it has one valid session_id field, whatever else is wrong with it: that
-- session's user gets the dead_lettered event.
local function inspect(f)
  local sid, msg_id, text, repeated, policy, deliver_at, timer
  local sids, extra, size = 0, 0, 0
  for i = 1, #f, 2 do
    local name, value = f[i], f[i + 1]
    size = size + #name + #value
    if name == 'session_id' then
      sids = sids + 1
      sid = value
    elseif name == 'msg_id' or name == 'text' or name == 'multitask' then
      if (name == 'msg_id' and msg_id) or (name == 'text' and text)
          or (name == 'multitask' and policy) then
        repeated = name
      end
      if name == 'msg_id' then msg_id = value
      elseif name == 'text' then text = value
      else policy = value end
    else
      extra = extra + 1
      if name == 'deliver_at' then
        if deliver_at then repeated = name end
        deliver_at = value
      elseif name == 'timer' then
        timer = true
      end
    end
  end
  if sids > 1 then return 'field session_id appears more than once', nil, nil end
  local problem = id_problem('session_id', sid)
  if problem then return problem, nil, nil end
  if repeated then return 'field ' .. repeated .. ' appears more than once', sid, nil end
  if extra > max_extra then
    return 'too many fields: ' .. extra .. ' besides session_id, text and msg_id (at most ' ..
      max_extra .. ')', sid, nil
  end
  -- The msg_id first: a refusal's reply event carries it only once it is known to be usable.
  if msg_id ~= nil then
    problem = id_problem('msg_id', msg_id)
    if problem then return problem, sid, nil end
  end
  if size > max_bytes then
    return 'entry is ' .. size .. ' bytes; at most ' .. max_bytes .. ' are allowed', sid, msg_id
  end
  if text == nil then return 'text is missing', sid, msg_id end
  if not string.find(text, '%S') then return 'text is empty', sid, msg_id end
  if policy ~= nil and not POLICIES[policy] then
    return 'multitask is not one of enqueue, reject, interrupt, coalesce, merge', sid, msg_id
  end
  if deliver_at ~= nil then
    -- Unix seconds, a fraction allowed (like expires_at); a value in ms is refused below
    -- as more than 366 days ahead.
    if not (string.find(deliver_at, '^%d+$') or string.find(deliver_at, '^%d+%.%d+$'))
        or #deliver_at > 20 then
      return 'deliver_at is not unix seconds (digits, optionally a fraction)', sid, msg_id
    end
    deliver_at = math.floor(tonumber(deliver_at) * 1000 + 0.5)
  end
  return nil, sid, msg_id, policy or default_policy, deliver_at, timer
end

-- A message sent with deliver_at in the future becomes a timer of its session (named
-- msg:<msg_id>; sending it again replaces it): fire-3.lua appends it when due, without
-- deliver_at and with a timer field, and it is sequenced then. Returns why not, or nil.
local MAX_DELIVER_AHEAD_MS = 366 * 86400 * 1000
local function defer(id, f, sid, msg_id, deliver_at, now)
  if deliver_at > now + MAX_DELIVER_AHEAD_MS then
    return 'deliver_at is more than 366 days ahead'
  end
  local name = 'msg:' .. (msg_id or id)
  local tkey = session_key(sprefix, sid, 'timers')
  local tk = redis.pcall('TYPE', tkey)
  if type(tk) ~= 'table' or (tk['ok'] ~= 'none' and tk['ok'] ~= 'hash') then
    return 'session timers ' .. tkey .. ' is not a hash'
  end
  if rcall('HEXISTS', tkey, 't:' .. name) == 0 and timer_count(tkey) >= MAX_TIMERS then
    return 'the session has ' .. MAX_TIMERS .. ' timers waiting (at most ' .. MAX_TIMERS .. ')'
  end
  local fields = {}
  for i = 1, #f, 2 do
    if f[i] ~= 'deliver_at' and f[i] ~= 'timer' then
      fields[#fields + 1] = f[i]
      fields[#fields + 1] = f[i + 1]
    end
  end
  if not msg_id then
    fields[#fields + 1] = 'msg_id'
    fields[#fields + 1] = id
  end
  fields[#fields + 1] = 'timer'
  fields[#fields + 1] = name
  set_timer(ready, sprefix, sid, name, deliver_at, false, fields)
  return nil
end

-- CRC-32 (zlib's) of a string, as an unsigned number; the table is built on first use.
local crc_table
local function crc32(str)
  if not crc_table then
    crc_table = {}
    for i = 0, 255 do
      local c = i
      for _ = 1, 8 do
        if bit.band(c, 1) == 1 then c = bit.bxor(bit.rshift(c, 1), 0xEDB88320)
        else c = bit.rshift(c, 1) end
      end
      crc_table[i] = c
    end
  end
  local crc = 0xFFFFFFFF
  for i = 1, #str do
    crc = bit.bxor(bit.rshift(crc, 8), crc_table[bit.band(bit.bxor(crc, string.byte(str, i)), 0xFF)])
  end
  crc = bit.bnot(crc)
  if crc < 0 then crc = crc + 4294967296 end
  return crc
end

-- nil when the session belongs to this stream's shard, else why not.
local function shard_problem(sid)
  if shards <= 1 then return nil end
  local owner = crc32(sid) % shards
  if owner == shard then return nil end
  return 'session_id belongs to shard ' .. owner .. ' of ' .. shards .. ', not to this stream (shard '
    .. shard .. '): append it to its own shard\'s stream'
end

local function job_row(kind, sid, token, seq, id, fields, h, ending)
  return {sid, token, seq, id, fields, h[1] or '', h[2] or '0', (tonumber(h[3]) or 0),
          h[4] or '', h[5] or '',
          ending or ending_of(sprefix, sid, seq, msg_id_of(id, fields), h[7], h[8])}
end

local replayed = replay_receipt(ready, token_base, sprefix, stream, job_row)
if replayed then
  -- The same call again: its jobs (their held successors come back through hand-off).
  return {'0-0', 0, replayed, {}, {0, 0, 0, 0, 0, 0, 0}}
end

local now = now_ms()

local entries
if claim_idle > 0 then
  entries = rcall('XAUTOCLAIM', stream, group, consumer, claim_idle, '0-0', 'COUNT', count)[2]
else
  local read = rcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count, 'STREAMS', stream, '>')
  entries = read and read[1][2] or {}
end

local acks, dels, jobs, held, receipt = {}, {}, {}, {}, {}
local found = {}  -- msg_id, session_id, ...: for the console's find, written after the loop
local sessions, order = {}, {}
local tokens = 0
local runnable = {}  -- sessions whose next message arrived in this call and may start
local later = {}  -- their later entries read in this call, in stream order
local dups, refused, contended, rejected = 0, 0, 0, 0

-- The entry's fields named by ARGV[16], as reply extras (the first of a repeated name).
local function echoed(f)
  local extra, seen = {}, {}
  for i = 1, #f - 1, 2 do
    if ECHO[f[i]] and not seen[f[i]] then
      seen[f[i]] = true
      extra[#extra + 1] = f[i]
      extra[#extra + 1] = f[i + 1]
    end
  end
  return extra
end

local function refuse(id, f, problem, sid, msg_id)
  local letter = letter_fields(f)
  for _, v in ipairs({'error', problem, 'error_kind', 'malformed', 'attempts', '1',
      'first_failed_at', now, 'last_failed_at', now, 'consumer', consumer,
      'worker_version', ARGV[10], 'source_stream', stream, 'source_entry_id', id}) do
    letter[#letter + 1] = v
  end
  rcall('XADD', dlq, '*', unpack(letter))
  refused = refused + 1
  if sid then
    reply_event(replies, maxlen, sid, msg_id or id, 0, 'dead_lettered', fallback, now, id,
                echoed(f))
  end
  dels[#dels + 1] = id
  if sid then  -- the letter just added is the stream's last
    index_letter(ready, sprefix, sid, rcall('XREVRANGE', dlq, '+', '-', 'COUNT', 1)[1][1])
  end
end

-- A dedupe key can outlive its session's state (DIALOG_DEDUPE_TTL_S longer than
-- DIALOG_STATE_TTL_S): its seq then names a message of the session's earlier life, and the
-- same seq now is another message. So a copy is matched to its original by msg_id too.
local function original_reply(s, seq, msg_id)
  if seq < 1 or seq > s.a then return '' end
  local ok, doc = pcall(cjson.decode, rcall('HGET', s.state, 'd') or '')
  if not ok or type(doc) ~= 'table' or type(doc['history']) ~= 'table' then return '' end
  for _, turn in ipairs(doc['history']) do
    if type(turn) == 'table' and turn['seq'] == seq and type(turn['bot']) == 'string'
        and (turn['msg_id'] == nil or turn['msg_id'] == msg_id) then
      return turn['bot']
    end
  end
  return ''
end

-- Whether the original of a copy is still outstanding: its seq is, and that seq's message
-- carries this msg_id (sequenced in this call, or its stored fields say so).
local function original_outstanding(s, seq, msg_id)
  if seq <= s.a or seq > s.last then return false end
  if seq > s.last_read then return s.msg_ids[seq] == msg_id end
  local _, f = load_message(stream, rcall('HGET', s.state, 'q' .. seq))
  f = f or {}
  for i = 1, #f - 1, 2 do
    if f[i] == 'msg_id' then return f[i + 1] == msg_id end
  end
  return false
end

-- The session's bookkeeping, or nil and why not: a state key of another type (written by
-- hand) must not fail this call after its first writes, so it is read with pcall and the
-- entry is refused alone. (Once HMGET has worked the key is a hash for the rest of the call.)
local function session(sid)
  local s = sessions[sid]
  if not s then
    local state = session_key(sprefix, sid, 'state')
    -- One read for the common case (the session's next message, lock free): the state
    -- document and attempts come along.
    local h = redis.pcall('HMGET', state, 'a', 's', 'd', 'v', 'n', 'f', 'e', 'xc', 'xs', 'h',
                          'tc', 'ie', 'w')
    if h['err'] then
      return nil, 'session state ' .. state .. ': ' .. h['err']
    end
    s = {state = state, lock = session_key(sprefix, sid, 'lock'), a = tonumber(h[1]) or 0,
         last = tonumber(h[2]) or 0, writes = {}, indexed = {}, token = nil, h = h,
         xc = tonumber(h[8]) or 0, xs = tonumber(h[9]) or 0, held = h[10],
         no_message_timers = h[11] == '0', index_expires = tonumber(h[12]), parked = h[13]}
    s.last_read, s.msg_ids, s.ids = s.last, {}, {}
    sessions[sid] = s
    order[#order + 1] = sid
  end
  return s
end

-- The seq a dedupe key recorded (false: none), or nil and why it cannot be read. With claim
-- (the seq the message gets if it is new), a key that does not exist is set to it by the same
-- command: one command instead of a GET and a SET for every new message.
local function dedupe_seen(dkey, claim)
  local seen
  if claim then
    seen = redis.pcall('SET', dkey, claim, 'EX', dedupe_ttl, 'NX', 'GET')
  else
    seen = redis.pcall('GET', dkey)
  end
  if type(seen) == 'table' and seen['err'] then
    return nil, 'dedupe key ' .. dkey .. ': ' .. seen['err']
  end
  return seen
end

-- A rejected message leaves no trace but its reply event, which a reader that starts later
-- (another client, a gateway started since) cannot find: its partial stream gets an end
-- (outcome rejected, seq 0, i: its entry id, so the client that sends the msg_id again can
-- tell this end from its new message's), as emit-2.lua writes one, kept partial_ttl. It
-- replaces the stream of an earlier message under the same msg_id, which has ended (a msg_id
-- is rejected only when it is free). Its msg_id joins the session's index (for delete) after
-- the loop. pcall: a key of another type (written by hand) refuses the end, not the call.
local REJECTED_END_ID = '18446744073709551615-0'  -- an end's id (emit-2.lua)

local function mark_rejected(s, sid, mid, id)
  if partial_ttl <= 0 then return end
  local pkey = session_key(sprefix, sid, 'partial:' .. mid)
  local fields = {'a', 0, 'p', 0, 's', 0, 'k', 'e', 't', '', 'o', 'rejected', 'i', id}
  local got = redis.pcall('XADD', pkey, REJECTED_END_ID, unpack(fields))
  if type(got) == 'table' and got['err'] and string.sub(got['err'], 1, 9) ~= 'WRONGTYPE' then
    redis.pcall('DEL', pkey)  -- an earlier message's end has that id
    got = redis.pcall('XADD', pkey, REJECTED_END_ID, unpack(fields))
  end
  if type(got) == 'table' and got['err'] then return end
  redis.pcall('EXPIRE', pkey, partial_ttl)
  s.rejected = s.rejected or {}
  s.rejected[#s.rejected + 1] = mid
end

-- When the session's next message is the first of a burst waiting to merge (its lock free):
-- that message's arrival (ms), kept in s.merge_first; else false.
local function merge_first_of(s, sid)
  if s.merge_first == nil then
    s.merge_first = false
    if rcall('EXISTS', s.lock) == 0 then
      local id, f = load_message(stream, rcall('HGET', s.state, 'q' .. (s.a + 1)))
      if id and is_merge_part(f, merge) then s.merge_first = entry_ms(id) end
    end
  end
  return s.merge_first
end

-- An interrupting or coalescing message (seq) arrived while the session has messages
-- outstanding. interrupt: all of them end cancelled in their turn (xc), and the running one
-- (the next to apply, when the lock is held) gets a cancel mark, which its worker watches
-- for; coalesce: those not running yet end superseded in their turn (xs).
local function interrupt_or_coalesce(s, sid, seq, policy)
  if s.parked then
    -- Its next message waits for a person (interrupt-3.lua): resume-3.lua looks now and ends
    -- that wait (the message ends cancelled or superseded, below), not a lease from now.
    rcall('ZADD', ready, now, sid)
    kick(ready)
    s.ensured = true
  end
  if policy == 'coalesce' then
    s.xs = seq
    s.writes[#s.writes + 1] = 'xs'
    s.writes[#s.writes + 1] = seq
    return
  end
  s.xc = seq
  s.writes[#s.writes + 1] = 'xc'
  s.writes[#s.writes + 1] = seq
  local running = s.a + 1
  if s.runnable and s.runnable[1] == running then
    s.runnable[4] = 'cancelled'  -- handed out by this very call: it ends without a step
  elseif rcall('EXISTS', s.lock) == 1 then
    local mid = s.ids[running]
    if not mid then
      local id, f = load_message(stream, rcall('HGET', s.state, 'q' .. running))
      mid = id and msg_id_of(id, f)
    end
    if mid then
      rcall('SET', cancel_key(sprefix, sid, mid), now, 'EX', dedupe_ttl)
      note_cancel(sprefix)
    end
  end
end

-- The inbound stream as the last call left it, against what it is now (see the header; both
-- read at the start: the read above changes neither the length nor entries-added).
local trimmed, ahead = 0, 0
if info['err'] then
  -- Not allowed (an ACL without XINFO STREAM): detection is off, and the hash says why.
  redis.pcall('HSET', inbound, 'error', 'XINFO STREAM: ' .. info['err'])
else
  local added, length = tonumber(stream_info['entries-added']), tonumber(stream_info['length'])
  if added and length and not before['err'] then
    local added_before, length_before = tonumber(before[1]), tonumber(before[2])
    if added_before and length_before then
      -- A stream deleted and created again counts its additions from 0.
      if added < added_before then added_before = 0 end
      trimmed = math.max(0, length_before + added - added_before - length)
    end
    local last = stream_info['last-generated-id'] or '0-0'
    local last_ms = tonumber(string.match(last, '^(%d+)')) or 0
    local writes = {'added', added, 'length', length - #entries}
    if trimmed > 0 then
      redis.pcall('HINCRBY', inbound, 'trimmed', trimmed)  -- a count written by hand: kept
    end
    if last_ms > now + AHEAD_MS then
      if not before[3] then ahead = 1 end
      writes[#writes + 1] = 'ahead'
      writes[#writes + 1] = last
    elseif before[3] then
      rcall('HDEL', inbound, 'ahead')
    end
    if before[4] then rcall('HDEL', inbound, 'error') end
    if tonumber(before[1]) ~= added or tonumber(before[2]) ~= length - #entries
        or (#writes > 4 and before[3] ~= last) then
      rcall('HSET', inbound, unpack(writes))  -- not when it says so already (an idle call)
    end
  end
end

for _, e in ipairs(entries) do
  local id, f = e[1], e[2]
  acks[#acks + 1] = id
  local problem, sid, msg_id, policy, deliver_at, timer = inspect(f)
  local s, dkey, seen, deferred, claimed
  if not problem then
    problem = shard_problem(sid)  -- before any key of the session is read or written here
  end
  if not problem and deliver_at and deliver_at > now then
    problem = defer(id, f, sid, msg_id, deliver_at, now)
    deferred = not problem
  end
  if not problem and not deferred then
    s, problem = session(sid)
  end
  if not problem and msg_id then
    dkey = session_key(sprefix, sid, 'msg:' .. msg_id)
    -- A new message is sequenced below unless it is rejected, which leaves its msg_id free.
    claimed = s and not (policy == 'reject' and s.last > s.a) and s.last + 1
    seen, problem = dedupe_seen(dkey, claimed)
  end
  if deferred then
    dels[#dels + 1] = id  -- it waits as a timer now (sequenced when it fires)
  elseif problem then
    refuse(id, f, problem, sid, msg_id)
  else
    local seq = seen and (tonumber(seen) or 0)
    local outstanding = seq and original_outstanding(s, seq, msg_id)
    local waiting = outstanding and rcall('HGET', s.state, 'u' .. seq)
    if outstanding and #(waiting or '') < MAX_WAITING_COPIES_BYTES then
      -- The original is not applied yet: its commit answers this copy, with its reply.
      rcall('HSET', s.state, 'u' .. seq, (waiting and waiting .. ',' or '') .. id)
      dels[#dels + 1] = id
      dups = dups + 1
    elseif seq then
      local reply = original_reply(s, seq, msg_id)
      reply_event(replies, maxlen, sid, msg_id, seq, 'duplicate', reply, now, id, echoed(f))
      dels[#dels + 1] = id
      dups = dups + 1
    elseif policy == 'reject' and s.last > s.a then
      -- Another message is in progress: this one ends here, unsequenced (its msg_id free).
      reply_event(replies, maxlen, sid, msg_id or id, 0, 'rejected', '', now, id, echoed(f))
      mark_rejected(s, sid, msg_id or id, id)
      dels[#dels + 1] = id
      rejected = rejected + 1
    else
      local seq = s.last + 1
      if s.last > s.a and (policy == 'interrupt' or policy == 'coalesce') then
        interrupt_or_coalesce(s, sid, seq, policy)
      end
      s.last = seq
      s.indexed[#s.indexed + 1] = msg_id or id  -- its msg_id index, written after the loop
      if not timer and not s.timers_checked then
        -- Only a user message cancels timers, and none that cancel_on_message can be set
        -- later in this call (deferred entries' timers are not), so one look per call will
        -- do, and none while the state's tc says there is none (cancel_message_timers).
        if not s.no_message_timers then
          cancel_message_timers(ready, sprefix, sid)
          s.writes[#s.writes + 1] = 'tc'
          s.writes[#s.writes + 1] = 0
        end
        s.timers_checked = true
      end
      if dkey then
        s.msg_ids[seq] = msg_id  -- its dedupe key was set to seq when it was looked up
      end
      s.writes[#s.writes + 1] = 'q' .. seq
      s.writes[#s.writes + 1] = pack_message(id, f)
      s.ids[seq] = msg_id or id
      dels[#dels + 1] = id
      found[#found + 1] = msg_id or id
      found[#found + 1] = sid
      if seq == s.a + 1 then
        -- The session had nothing outstanding: it may carry its idle TTL, and it joins the
        -- ready set, where it stays while anything is outstanding (and the ages).
        rcall('PERSIST', s.state)
        rcall('ZADD', ages_key(ready), entry_ms(id), sid)
        if s.held then
          contended = contended + 1  -- held: it waits for a release or redrive
        elseif rcall('EXISTS', s.lock) == 1 then
          -- A lock with nothing outstanding: look again when its lease ends (under a worker
          -- lease: at its holder's place, where a lapse of that lease finds it).
          contended = contended + 1
          rcall('ZADD', ready, held_until(now, math.max(rcall('PTTL', s.lock), 0),
                                          redis.pcall('GET', s.lock)), sid)
        elseif policy == 'merge' and merge.window > 0 then
          -- The first of a burst to merge: handed out when its window closes (resume-3.lua);
          -- later parts move that on (below), up to the longest wait.
          s.merge_first = entry_ms(id)
          rcall('ZADD', ready, s.merge_first + math.min(merge.window, merge.max), sid)
        else
          -- It may start: it takes a slot or joins its tenant's queue after the loop.
          -- Its ending as it is handed out (a later coalescing entry of this call does not
          -- supersede it; an interrupting one cancels it, interrupt_or_coalesce).
          s.runnable = {seq, id, f, ending_of(sprefix, sid, seq, msg_id or id, s.xc, s.xs)}
          runnable[#runnable + 1] = sid
        end
      elseif s.runnable then
        later[#later + 1] = {sid, seq, id, f}  -- handed on by its commit, if it takes a slot now
      elseif policy == 'merge' and merge.window > 0 and not s.held
          and (s.merge_first or merge_first_of(s, sid)) then
        -- A later part of a burst waiting to merge: its window closes later, up to the
        -- longest wait from the first part (GT: never earlier than it was).
        local close = math.min(entry_ms(id) + merge.window, s.merge_first + merge.max)
        rcall('ZADD', ready, 'GT', close, sid)
      else
        contended = contended + 1
        if not s.ensured and not s.held then
          -- Outstanding work always has a place in the ready set; NX keeps the holder's lease.
          rcall('ZADD', ready, 'NX', now + look_again, sid)
          s.ensured = true
        end
      end
    end
  end
end

-- The sessions that may start: while no session of the shard waits in a queue and there are
-- slots for all of them, each takes its lock now, in stream order (one tenant's traffic
-- costs no queue); otherwise they join their tenants' queues and the free slots go out in
-- fair order (dispatch in _common.lua), after the writes below.
local sched = scheduler(ready, sprefix, stream, now, lock_ttl, token_base, tenant_pattern)
sched.merge = merge  -- a queued burst handed out here goes with its parts
-- While nobody waits in the shard's queues, the sessions that may start take the free slots at
-- once, in stream order, each within its tenant's maximum, when they are all one tenant's or
-- there is a slot for each (nothing to share out); the rest join their tenants' queues, and
-- the free slots left go out in fair order (dispatch, after the writes below).
local distinct = {}
for _, sid in ipairs(runnable) do
  local s = sessions[sid]
  s.tenant = tenant_of(s.runnable[3], sid, tenant_pattern)
  distinct[s.tenant] = true
end
local one_tenant = next(distinct) == nil or next(distinct, next(distinct)) == nil
-- An entry that names a tenant puts tenants in use for the shard (every worker's reader then
-- reads ahead while its slots are full, so the fair order sees every tenant's messages): the
-- mark lasts NAMED_KEEP_S after the last such call; one command per such call, none where no
-- entry ever names a tenant.
for t in pairs(distinct) do
  if t ~= DEFAULT_TENANT then
    rcall('SET', ready .. ':named', 1, 'EX', NAMED_KEEP_S)
    break
  end
end
local queues_empty = rcall('EXISTS', active_key(ready)) == 0
local at_once = queues_empty and (one_tenant or #runnable <= free_slots)
local direct, taken_by = 0, {}
for _, sid in ipairs(runnable) do
  local s = sessions[sid]
  local seq, id, f, ending = s.runnable[1], s.runnable[2], s.runnable[3], s.runnable[4]
  local tenant = s.tenant
  local now_ok = at_once and direct < free_slots
  if now_ok then
    local mx = tenant_conf(sched, tenant).max
    now_ok = mx == 0 or in_flight(sched, tenant) + (taken_by[tenant] or 0) < mx
  end
  if now_ok then
    direct, taken_by[tenant], s.direct = direct + 1, (taken_by[tenant] or 0) + 1, true
    tokens = tokens + 1
    s.token = token_base .. ':' .. tokens
    rcall('SET', s.lock, s.token, 'PX', lock_ttl)
    local h = {s.h[3], s.h[4], s.h[5], s.h[6], s.h[7]}
    local attempts = (tonumber(h[3]) or 0) + 1
    busy_add(sched, tenant, sid)
    s.writes[#s.writes + 1] = 'n'
    s.writes[#s.writes + 1] = attempts
    s.writes[#s.writes + 1] = 'T'
    s.writes[#s.writes + 1] = tenant
    rcall('ZADD', ready, held_until(now, lock_ttl, s.token), sid)
    jobs[#jobs + 1] = {sid, s.token, seq, id, f, h[1] or '', h[2] or '0', attempts,
                       h[4] or '', h[5] or '', ending}
    receipt[#receipt + 1] = {'m', sid, s.token, seq, id, jobs[#jobs][11]}
  else
    enqueue(sched, sid, f, entry_order(id))
    queues_empty = false
  end
end
for _, entry in ipairs(later) do  -- a taken session's later entries go with its job
  if sessions[entry[1]].direct then held[#held + 1] = entry end
end

for _, sid in ipairs(order) do
  local s = sessions[sid]
  if #s.indexed > 0 then
    local expires = index_msg_ids(sprefix, sid, s.indexed, s.last - #s.indexed + 1, s.last,
                                  now + dedupe_ttl * 1000, dedupe_ttl * 1000, s.index_expires)
    if expires then
      s.writes[#s.writes + 1] = 'ie'  -- when its msg_id index expires (index_msg_ids)
      s.writes[#s.writes + 1] = expires
      s.index_expires = expires
    end
  end
  if s.rejected then  -- their partial streams hold their ends (mark_rejected)
    local expires = index_msg_ids(sprefix, sid, s.rejected, s.last, s.last,
                                  now + dedupe_ttl * 1000, dedupe_ttl * 1000, s.index_expires)
    if expires then
      s.writes[#s.writes + 1] = 'ie'
      s.writes[#s.writes + 1] = expires
    end
  end
  if #s.writes > 0 then
    rcall('HSET', s.state, 's', s.last, unpack(s.writes))
  end
end
if not queues_empty and free_slots > direct then
  for _, row in ipairs(dispatch(sched, free_slots - direct)) do jobs[#jobs + 1] = row end
  for _, item in ipairs(sched.receipt) do receipt[#receipt + 1] = item end
end

-- Sessions that received a message, by id (score 0: ordered by the id's bytes), in buckets of
-- DIALOG_DEDUPE_TTL_S each kept two buckets long: the console finds sessions by id prefix in
-- the current and the previous bucket (ZRANGEBYLEX), never by scanning keys.
local seen_bucket = ready .. ':sessions:' .. math.floor(now / (dedupe_ttl * 1000))
local seen = {}
for _, sid in ipairs(order) do
  if #sessions[sid].writes > 0 then
    seen[#seen + 1] = 0
    seen[#seen + 1] = sid
  end
end
local new_in_bucket = 0
for i = 1, #seen, 1000 do  -- one ZADD per 500 sessions (unpack's limit)
  local upto = math.min(i + 999, #seen)
  new_in_bucket = new_in_bucket + rcall('ZADD', seen_bucket, unpack(seen, i, upto))
end
-- Its expiry, set by any call of its period, outlasts the next period; a call that adds no
-- session did not create it (the call that did set it), so only one adding a session sets it.
if new_in_bucket > 0 then rcall('EXPIRE', seen_bucket, 2 * dedupe_ttl + 60) end
-- Which session each sequenced msg_id went to (a msg_id sent to several sessions names the
-- last), in this quarter's hash (see find_quarter). pcall: a key of another type (written by
-- hand) must not fail the call after its writes; those messages cannot be found, no more.
-- Its expiry is set by the call that made it, told by a field no msg_id can name (control
-- characters are refused), FOUND_MARK, in every call's first HSET: only when every field of
-- that HSET is new can it be the first (else the hash was there, with its expiry). Delete
-- removes msg_ids only, so the hash is never emptied and made again without one.
local FOUND_MARK = '\n'
local found_bucket = ready .. ':msgs:' .. find_quarter(now, dedupe_ttl)
local made = false
for i = 1, #found, 1000 do  -- one HSET per 500 messages (unpack's limit)
  local upto = math.min(i + 999, #found)
  if i == 1 then
    local names, distinct = {}, 1
    for k = 1, upto, 2 do
      if not names[found[k]] then names[found[k]], distinct = true, distinct + 1 end
    end
    made = redis.pcall('HSET', found_bucket, FOUND_MARK, 1, unpack(found, 1, upto)) == distinct
  else
    redis.pcall('HSET', found_bucket, unpack(found, i, upto))
  end
end
if made then
  redis.pcall('EXPIRE', found_bucket, math.ceil(dedupe_ttl * (FIND_PERIODS + 1) / FIND_PERIODS) + 60)
end
if #acks > 0 then
  rcall('XACK', stream, group, unpack(acks))
end
if #dels > 0 then
  rcall('XDEL', stream, unpack(dels))  -- every entry read: custody (see the header)
end

if #receipt > 0 then
  save_receipt(ready, token_base, look_again, receipt)
end

local last_id
if #entries > 0 then
  last_id = entries[#entries][1]
else
  last_id = '0-0'
  for _, g in ipairs(rcall('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then last_id = info['last-delivered-id'] end
  end
end
-- Whether sessions of the shard still wait in its queues (for a slot another worker has).
local waiting = (not queues_empty) and rcall('EXISTS', active_key(ready)) or 0
return {last_id, #entries, jobs, held,
        {dups, refused, contended, trimmed, ahead, rejected, waiting}}
