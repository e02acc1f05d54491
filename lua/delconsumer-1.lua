--[[
  delconsumer: delete an idle consumer only if it owns no pending entries. XGROUP DELCONSUMER
  drops a consumer's pending entries for good, so the check and the delete must be one step:
  a consumer that reads between a separate check and the delete would lose what it read.

  KEYS[1] inbound stream
  ARGV[1] group   ARGV[2] consumer   ARGV[3] minimum idle time (ms)

  Returns 1 (deleted) or 0 (kept: it owns entries or is not idle enough or is unknown).
]]
local rcall = redis.call

for _, c in ipairs(rcall('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #c, 2 do
    info[c[i]] = c[i + 1]
  end
  if info['name'] == ARGV[2] then
    if tonumber(info['pending']) == 0 and tonumber(info['idle']) >= tonumber(ARGV[3]) then
      rcall('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
      return 1
    end
    return 0
  end
end
return 0
