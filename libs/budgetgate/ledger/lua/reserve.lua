-- Check and reserve everything one decision needs, or nothing: budget charges on ledger keys,
-- concurrency on quota counters, and tokens in pools.
-- KEYS: [1] loaded marker, [2] run key (its budget charges), [3] run holds key (its counters
--       and tokens), then n ledger keys, m counter keys, and 4 keys per pool level (pools.lua).
-- ARGV: [1] decision id, [2] now ms, [3] n, [4] m, [5] pool levels,
--       then per ledger key: amount, limit, hard (1|0);
--       per counter: gpus, nodes, allocations to add, then their limits (-1 = none);
--       then token, project, sub-namespace, lease expiry ms; per pool level: quota,
--       project cap, sub-namespace cap (-1 = none).
-- Returns {status, ledger (reserved, consumed)..., counter (gpus, nodes, allocations)...,
-- pool (check, used, by project, by sub-namespace)...}; status is RESERVED, REJECTED (something
-- lacks room; nothing changed), NOT_LOADED (rebuild from Postgres first), MISSING (a ledger
-- key was never loaded; its index follows) or DUPLICATE (this run holds already; decision id).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {'DUPLICATE', redis.call('HGET', KEYS[2], '_decision') or ''}
end
local now = tonumber(ARGV[2])
local n, m, levels = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local reply = {'RESERVED'}
local fits = true

for i = 1, n do
  local state = redis.call('HMGET', KEYS[3 + i], 'reserved', 'consumed')
  if not state[1] then
    return {'MISSING', tostring(i)}
  end
  local reserved, consumed = tonumber(state[1]), tonumber(state[2] or '0')
  local a = 5 + 3 * (i - 1)
  if ARGV[a + 3] == '1' and tonumber(ARGV[a + 1]) > tonumber(ARGV[a + 2]) - reserved - consumed then
    fits = false
  end
  reply[#reply + 1] = reserved
  reply[#reply + 1] = consumed
end

local counters = 5 + 3 * n
for j = 1, m do
  local held = redis.call('HMGET', KEYS[3 + n + j], 'gpus', 'nodes', 'allocations')
  local a = counters + 6 * (j - 1)
  for f = 1, 3 do
    local current = tonumber(held[f] or '0')
    local limit = tonumber(ARGV[a + 3 + f])
    if limit >= 0 and current + tonumber(ARGV[a + f]) > limit then
      fits = false
    end
    reply[#reply + 1] = current
  end
end

local pools = counters + 6 * m
local token, project, subns = ARGV[pools + 1], ARGV[pools + 2], ARGV[pools + 3]
local expiry = tonumber(ARGV[pools + 4])
for l = 1, levels do
  local k = pool_keys(4 + n + m + 4 * (l - 1))
  pool_purge(k, now)
  local a = pools + 4 + 3 * (l - 1)
  local status, used, by_project, by_subns = pool_check(k, token, project, subns, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
  if status == 'EXHAUSTED' or status == 'CAP' then
    fits = false
  end
  reply[#reply + 1] = status
  reply[#reply + 1] = used
  reply[#reply + 1] = by_project
  reply[#reply + 1] = by_subns
end

if not fits then
  reply[1] = 'REJECTED'
  return reply
end

for i = 1, n do
  local amount = ARGV[5 + 3 * (i - 1) + 1]
  redis.call('HINCRBY', KEYS[3 + i], 'reserved', amount)
  redis.call('HSET', KEYS[2], KEYS[3 + i], amount)
end
for j = 1, m do
  local a = counters + 6 * (j - 1)
  local key = KEYS[3 + n + j]
  redis.call('HINCRBY', key, 'gpus', ARGV[a + 1])
  redis.call('HINCRBY', key, 'nodes', ARGV[a + 2])
  redis.call('HINCRBY', key, 'allocations', ARGV[a + 3])
  redis.call('HSET', KEYS[3], key, ARGV[a + 1] .. ',' .. ARGV[a + 2] .. ',' .. ARGV[a + 3])
end
for l = 1, levels do
  local k = pool_keys(4 + n + m + 4 * (l - 1))
  pool_take(k, token, project, subns, expiry)
  redis.call('HSET', KEYS[3], k[1], token)
end
redis.call('HSET', KEYS[2], '_decision', ARGV[1], '_at', ARGV[2])
return reply
