-- Apply one run's settlement: move amounts on its ledger keys and rewrite what the run holds,
-- all at once (the reconciler computed the changes from Postgres, which it commits after this).
-- KEYS[1] loaded marker, KEYS[2] run key, KEYS[3..] ledger keys.
-- ARGV[1] decision id, ARGV[2] now (ms), ARGV[3] '1' when the run holds nothing any more (its
-- ledger holds leave the run key), then per ledger key: reserved delta, consumed delta, and what the run holds on
-- it afterwards ('' for a key the run has no reservation on).
-- Returns 'OK', NOT_LOADED (rebuild from Postgres first) or MISSING with the index of the
-- first ledger key never loaded; nothing is changed unless the answer is OK.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
local n = #KEYS - 2
for i = 1, n do
  if redis.call('EXISTS', KEYS[2 + i]) == 0 then
    return {'MISSING', tostring(i)}
  end
end
for i = 1, n do
  local reserved = tonumber(ARGV[1 + 3 * i])
  local consumed = tonumber(ARGV[2 + 3 * i])
  if reserved ~= 0 then
    redis.call('HINCRBY', KEYS[2 + i], 'reserved', reserved)
  end
  if consumed ~= 0 then
    redis.call('HINCRBY', KEYS[2 + i], 'consumed', consumed)
  end
end
if ARGV[3] == '1' then
  -- The run's ledger holds go; anything else its run key holds (quota counters, pool leases)
  -- is not this script's to give back, so the key itself goes only once nothing else is left.
  for i = 1, n do
    if ARGV[3 + 3 * i] ~= '' then
      redis.call('HDEL', KEYS[2], KEYS[2 + i])
    end
  end
  if redis.call('HLEN', KEYS[2]) <= 2 then
    redis.call('DEL', KEYS[2])
  end
  return 'OK'
end
for i = 1, n do
  local held = ARGV[3 + 3 * i]
  if held ~= '' then
    redis.call('HSET', KEYS[2], KEYS[2 + i], held)
  end
end
redis.call('HSET', KEYS[2], '_decision', ARGV[1])
redis.call('HSETNX', KEYS[2], '_at', ARGV[2])
return 'OK'
