-- Grow or shrink an escrow lease (budgetgate.ledger.escrow_leases): the size field of a ledger key whose
-- reservations are tested against it (reserve.lua's lease charges) instead of a limit.
--
-- Called inside the Postgres transaction that writes the same move, the lease's row locked:
-- Postgres's size is the truth. A grant is Postgres's first (a lost grow leaves Redis's lease
-- smaller, never larger); a return shrinks here first, never below what the root holds
-- (reserved + consumed), and advances the ledger sequence, which Postgres records with the move
-- (ledger_marks): a Redis that lost the shrinking is behind and is rebuilt before it decides.
--
-- A lease of a counter is sized in a unit (its unit field, gpus or nodes: the pool's when it was
-- granted); in another unit it holds nothing. 'void' empties such a lease whatever its unit (the
-- pool is now counted in ARGV[5]), advancing the sequence as a return does.
--
-- KEYS: [1] loaded marker, [2] sequence, [3] the lease's ledger key (or counter key).
-- ARGV: [1] sequence Postgres committed, [2] the lease's size in Postgres (what Redis must hold;
--       for 'void' its size whatever its unit, else its size in unit ARGV[5]), [3] 'grow',
--       'shrink' or 'void', [4] amount, [5] for a lease of a counter: the unit its use is
--       counted in (gpus or nodes), its ledger key's reserved + consumed otherwise.
-- Returns NOT_LOADED (rebuild first; also when Redis is behind ARGV[1]), MISSING (the key was
-- never loaded), {'STALE', size} (Redis's size is not Postgres's: rebuild), or
-- {'OK', moved, sequence}: what it grew or shrank by (a shrink: at most what is unused), and the
-- sequence a shrink advanced to (0 for a grow, or a shrink of nothing).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return {'NOT_LOADED'}
end
local used, size
if ARGV[5] then
  -- a lease of a counter tenants share (the sensitive pool): what its tenant's runs hold of the
  -- pool's unit (field ARGV[5]) is its use; a counter never counted on holds nothing, size 0
  local state = redis.call('HMGET', KEYS[3], ARGV[5], 'size', 'unit')
  used, size = tonumber(state[1] or '0'), tonumber(state[2] or '0')
  if ARGV[3] == 'void' then
    if size ~= tonumber(ARGV[2]) then
      return {'STALE', size}
    end
    redis.call('HSET', KEYS[3], 'size', 0, 'unit', ARGV[5])
    if size == 0 then
      return {'OK', 0, 0}
    end
    return {'OK', size, redis.call('INCRBY', KEYS[2], SEQ_STEP)}
  end
  if state[3] ~= ARGV[5] then
    size = 0
  end
else
  local state = redis.call('HMGET', KEYS[3], 'reserved', 'consumed', 'size')
  if not state[1] then
    return {'MISSING'}
  end
  used, size = tonumber(state[1]) + tonumber(state[2] or '0'), tonumber(state[3] or '0')
end
if size ~= tonumber(ARGV[2]) then
  return {'STALE', size}
end
local amount = tonumber(ARGV[4])
if ARGV[3] == 'grow' then
  redis.call('HSET', KEYS[3], 'size', size + amount)
  if ARGV[5] then
    redis.call('HSET', KEYS[3], 'unit', ARGV[5])
  end
  return {'OK', amount, 0}
end
local unused = size - used
local moved = math.min(amount, math.max(unused, 0))
if moved <= 0 then
  return {'OK', 0, 0}
end
redis.call('HSET', KEYS[3], 'size', size - moved)
return {'OK', moved, redis.call('INCRBY', KEYS[2], SEQ_STEP)}
