-- Second half of one run's settlement (see settle_begin.lua): ARGV[2] 'commit' applies what was
-- left for after the Postgres commit (reserved and consumed decreases, what the run key holds),
-- 'undo' takes back the increases of a settlement Postgres never committed. Either way the
-- pending key goes. Idempotent: a settlement already ended (or wiped by a rebuild) is 'GONE'.
-- KEYS[1] loaded marker, KEYS[2] run key, KEYS[3] pending key, KEYS[4] the parked set,
-- KEYS[5..] the ledger keys the pending key names (read beforehand; 'STALE' if they are not exactly those).
-- ARGV[1] the settlement's sequence number, ARGV[2] 'commit' | 'undo', ARGV[3] the token it was
-- parked with, or '' for whichever settlement is parked under that number (the caller holds the
-- run's lock then). A late undo of a rolled-back settlement must not end the next one, which may
-- be parked under the same number.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
local parked = redis.call('HMGET', KEYS[3], 'seq', 'keys', 'args', 'token')
if not parked[1] then
  redis.call('SREM', KEYS[4], KEYS[3])
  return 'GONE'
end
if parked[1] ~= ARGV[1] or (ARGV[3] ~= '' and parked[4] ~= ARGV[3]) then
  return 'GONE'
end
local keys, args = cjson.decode(parked[2]), cjson.decode(parked[3])
local n = #KEYS - 4
if #keys ~= n then
  return {'STALE'}
end
for i = 1, n do
  if keys[i] ~= KEYS[4 + i] then
    return {'STALE'}
  end
end
redis.call('DEL', KEYS[3])
redis.call('SREM', KEYS[4], KEYS[3])
local undo = ARGV[2] == 'undo'
for i = 1, n do
  for j, field in ipairs({'reserved', 'consumed'}) do
    local delta = args[1 + j + 3 * i]
    local negative = string.sub(delta, 1, 1) == '-'
    if undo and not negative and delta ~= '0' then
      redis.call('HINCRBY', KEYS[4 + i], field, '-' .. delta)
    elseif not undo and negative then
      redis.call('HINCRBY', KEYS[4 + i], field, delta)
    end
  end
end
if undo then
  return 'OK'
end
if args[3] == '1' then
  -- The run's ledger holds go; anything else its run key holds (quota counters, pool leases)
  -- is not this script's to give back, so the key itself goes only once nothing else is left.
  for i = 1, n do
    if args[4 + 3 * i] ~= '' then
      redis.call('HDEL', KEYS[2], KEYS[4 + i])
    end
  end
  if redis.call('HLEN', KEYS[2]) <= 2 then
    redis.call('DEL', KEYS[2])
  end
  return 'OK'
end
for i = 1, n do
  local held = args[4 + 3 * i]
  if held ~= '' then
    redis.call('HSET', KEYS[2], KEYS[4 + i], held)
  end
end
redis.call('HSET', KEYS[2], '_decision', args[1])
redis.call('HSETNX', KEYS[2], '_at', args[2])
return 'OK'
