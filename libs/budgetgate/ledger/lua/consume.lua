-- Change what ledger keys have consumed, without any run (usage ageing out of rolling windows).
-- KEYS[1] loaded marker, KEYS[2..] ledger keys; ARGV[i] the consumed delta of KEYS[i + 1].
-- Returns 'OK', NOT_LOADED, or MISSING with the index of every key never loaded (nothing is
-- changed then: a key that is not loaded gets Postgres's figure when it is).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
local missing = {'MISSING'}
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    missing[#missing + 1] = tostring(i - 1)
  end
end
if #missing > 1 then
  return missing
end
for i = 2, #KEYS do
  if tonumber(ARGV[i - 1]) ~= 0 then
    redis.call('HINCRBY', KEYS[i], 'consumed', ARGV[i - 1])
  end
end
return 'OK'
