-- Give back everything one run holds, and forget the run.
-- KEYS[1] loaded marker, KEYS[2] run key, KEYS[3..] the ledger keys the run holds (read from the
-- run key beforehand, so the script touches only keys it is given).
-- ARGV[1] decision id the caller expects, or '' for any.
-- Returns the number of ledger keys released (0 when the run holds nothing), NOT_LOADED,
-- OTHER_DECISION when the run key belongs to another decision, or STALE_KEYS when the keys
-- given are not exactly those the run holds (nothing is changed then; read and call again).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  return 0
end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[2], '_decision') ~= ARGV[1] then
  return {'OTHER_DECISION'}
end
local fields = redis.call('HLEN', KEYS[2]) - 2
if fields ~= #KEYS - 2 then
  return {'STALE_KEYS'}
end
local amounts = {}
for i = 3, #KEYS do
  local amount = redis.call('HGET', KEYS[2], KEYS[i])
  if not amount then
    return {'STALE_KEYS'}
  end
  amounts[i] = amount
end
for i = 3, #KEYS do
  redis.call('HINCRBY', KEYS[i], 'reserved', -tonumber(amounts[i]))
end
redis.call('DEL', KEYS[2])
return #KEYS - 2
