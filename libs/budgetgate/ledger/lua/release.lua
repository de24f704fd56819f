-- Give back everything one run holds — budget reservations and concurrency holds — and forget
-- the run. KEYS: [1] loaded marker, [2] run key, [3] run holds key, then the ledger keys the run
-- key names (ARGV[2] of them), then the keys the holds key names (see holds.lua); all read
-- beforehand, so the script touches only keys it is given.
-- ARGV[1] decision id the caller expects, or '' for any; ARGV[2] number of ledger keys.
-- Returns the number of keys released (0 when the run holds nothing), NOT_LOADED,
-- OTHER_DECISION when the run key belongs to another decision, or STALE_KEYS when the keys
-- given are not exactly those the run holds (nothing is changed then; read and call again).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('EXISTS', KEYS[3]) == 0 then
  return 0
end
local decision = redis.call('HGET', KEYS[2], '_decision')
-- A named decision must be the run key's: holds without a run key (a quota-only run after a
-- rebuild) cannot be told apart from another decision's, and are not given back for one.
if ARGV[1] ~= '' and decision ~= ARGV[1] then
  return {'OTHER_DECISION'}
end
local n = tonumber(ARGV[2])
local fields = redis.call('HLEN', KEYS[2])
if fields > 0 and fields - 2 ~= n then
  return {'STALE_KEYS'}
end
local amounts = {}
for i = 4, 3 + n do
  local amount = redis.call('HGET', KEYS[2], KEYS[i])
  if not amount then
    return {'STALE_KEYS'}
  end
  amounts[i] = amount
end
local entries = holds_read(KEYS[3], 4 + n)
if not entries then
  return {'STALE_KEYS'}
end
for i = 4, 3 + n do
  redis.call('HINCRBY', KEYS[i], 'reserved', -tonumber(amounts[i]))
end
holds_release(KEYS[3], entries)
redis.call('DEL', KEYS[2])
return n + #entries
