-- Load one ledger key from Postgres's figures unless it is already present.
-- KEYS[1] loaded marker, KEYS[2] ledger key; ARGV[1] reserved, ARGV[2] consumed, and for an
-- escrow lease ARGV[3] its size (lease.lua).
-- Returns 1 when loaded, 0 when it was already there, or NOT_LOADED.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
redis.call('HSET', KEYS[2], 'reserved', ARGV[1], 'consumed', ARGV[2])
if ARGV[3] then
  redis.call('HSET', KEYS[2], 'size', ARGV[3])
end
return 1
