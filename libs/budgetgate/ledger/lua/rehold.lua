-- A run released at its start deadline that started after all (or was readmitted) holds its
-- quota counters again, whatever the caps: it is running, and every decision after this must
-- count it. KEYS: [1] loaded marker, [2] the run's holds key, [3] the ledger sequence (see
-- reserve.lua), then its counter keys. ARGV: per counter key: gpus, nodes, allocations.
-- Returns the ledger sequence it advanced to when taken now (Postgres records it: a Redis
-- restored from before it is then behind), 0 when the holds key exists already (taken before:
-- nothing is counted twice), or NOT_LOADED.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
for j = 4, #KEYS do
  local a = 3 * (j - 4)
  holds_count(KEYS[2], KEYS[j], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3])
end
return redis.call('INCRBY', KEYS[3], SEQ_STEP)
