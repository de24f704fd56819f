-- Allocate one token in a pool and its declared ancestors, all levels or none.
-- KEYS: [1] loaded marker, then 4 keys per pool level (see pools.lua), most specific first, and
-- last the ledger sequence (see reserve.lua).
-- ARGV: [1] token, [2] project, [3] sub-namespace, [4] now ms, [5] lease expiry ms,
--       then per level: quota, project cap, sub-namespace cap (-1 = none), and last the highest
--       ledger sequence Postgres committed: a Redis behind it is not current, and invalidates
--       itself as reserve.lua does (a grant is a decision too).
-- Returns {status, (check, used, by project, by sub-namespace) per level, and when granted the
-- ledger sequence it advanced to (Postgres records it with the token)}: status GRANTED,
-- RENEWED (the token held already; its lease is extended), EXHAUSTED, CAP, or NOT_LOADED.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
if tonumber(redis.call('GET', KEYS[#KEYS]) or '0') < tonumber(ARGV[#ARGV]) then
  redis.call('DEL', KEYS[1])
  return {'NOT_LOADED'}
end
local levels = (#KEYS - 2) / 4
local now, expiry = tonumber(ARGV[4]), tonumber(ARGV[5])
local reply = {'GRANTED'}
local outcome = 'GRANTED'
for l = 1, levels do
  local k = pool_keys(2 + 4 * (l - 1))
  pool_purge(k, now)
  local a = 5 + 3 * (l - 1)
  local status, used, by_project, by_subns = pool_check(k, ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
  if status == 'EXHAUSTED' and outcome ~= 'EXHAUSTED' then
    outcome = 'EXHAUSTED'
  elseif status == 'CAP' and outcome == 'GRANTED' then
    outcome = 'CAP'
  elseif status == 'HELD' and l == 1 and outcome == 'GRANTED' then
    outcome = 'RENEWED'
  end
  reply[#reply + 1] = status
  reply[#reply + 1] = used
  reply[#reply + 1] = by_project
  reply[#reply + 1] = by_subns
end
reply[1] = outcome
if outcome == 'GRANTED' or outcome == 'RENEWED' then
  for l = 1, levels do
    pool_take(pool_keys(2 + 4 * (l - 1)), ARGV[1], ARGV[2], ARGV[3], expiry)
  end
  reply[#reply + 1] = redis.call('INCRBY', KEYS[#KEYS], SEQ_STEP)
end
return reply
