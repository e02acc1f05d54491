--[[
  reshard-letter: re-add one dead letter to its session's new shard during `dialog-worker
  reshard`, at most once. The source (old dead-letter stream and entry id) is recorded in the
  target shard's progress set in the same atomic step as the XADD, so a reshard that is killed
  after this call and before it deleted the old entry re-adds nothing when it is run again.
  (The old and the new stream live in different Cluster slots: no single script can move the
  entry; the old one is deleted by the caller afterwards.)

  KEYS[1] target dead-letter stream   KEYS[2] the target shard's progress set (same slot)

  ARGV[1] source ("<old dead-letter stream> <entry id>")
  ARGV[2..] the entry's fields, name/value pairs, byte for byte

  Returns 1 (added) or 0 (added by an earlier run: nothing written).
]]
local target, moved = KEYS[1], KEYS[2]
if #ARGV < 3 or #ARGV % 2 ~= 1 then
  return redis.error_reply('ERR reshard-letter: bad arguments')
end
for _, check in ipairs({{target, 'stream'}, {moved, 'set'}}) do
  local err = expect_type(check[1], check[2])
  if err then return err end
end
if rcall('SISMEMBER', moved, ARGV[1]) == 1 then
  return 0
end
local fields = {}
for i = 2, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
rcall('XADD', target, '*', unpack(fields))
rcall('SADD', moved, ARGV[1])
return 1
