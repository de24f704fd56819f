-- Release one token from a pool and its ancestors.
-- KEYS: [1] loaded marker, then 4 keys per pool level. ARGV: [1] token.
-- Returns the number of levels the token was released from, or NOT_LOADED.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
local released = 0
for l = 1, (#KEYS - 1) / 4 do
  released = released + pool_drop(pool_keys(2 + 4 * (l - 1)), ARGV[1])
end
return released
