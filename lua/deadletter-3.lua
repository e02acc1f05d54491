--[[
  deadletter: an inbound entry that cannot be placed in any session's order (no valid
  session_id or seq) goes to the dead-letter stream with the reason; a fallback reply is
  written when the session is known. Entries that belong to a session are dead-lettered in
  order by commit-8.lua instead, which also advances applied_seq.

  KEYS[1] inbound stream   KEYS[2] dead-letter stream   KEYS[3] reply stream
  ARGV[1] group   ARGV[2] entry id   ARGV[3] dead-letter fields (JSON array of pairs)
  ARGV[4] reply fields (JSON array of pairs, without produced_at) or ""
  ARGV[5] reply stream MAXLEN (~, 0 = no trim)

  Returns 1, or 0 when the entry was already gone (someone else handled it).
]]
local rcall = redis.call

if rcall('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
rcall('XADD', KEYS[2], '*', unpack(cjson.decode(ARGV[3])))
if ARGV[4] ~= '' then
  local t = rcall('TIME')
  local reply = cjson.decode(ARGV[4])
  reply[#reply + 1] = 'produced_at'
  reply[#reply + 1] = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if tonumber(ARGV[5]) > 0 then
    rcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', unpack(reply))
  else
    rcall('XADD', KEYS[3], '*', unpack(reply))
  end
end
rcall('XDEL', KEYS[1], ARGV[2])
return 1
