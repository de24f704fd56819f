-- First half of one run's settlement, before Postgres commits it: only what makes the ledger
-- tighter is applied now (reserved and consumed increases), and the whole settlement is parked
-- in the run's pending key. settle_end.lua applies the rest once Postgres has committed (or
-- takes the increases back if it has not). In between, Redis never shows more room than either
-- Postgres state, so admission deciding on it cannot over-admit.
-- KEYS[1] loaded marker, KEYS[2] run key, KEYS[3] the run's pending key, KEYS[4] the set of
-- runs with a parked settlement, KEYS[5] the ledger sequence (see reserve.lua), KEYS[6..] ledger keys.
-- ARGV[1] decision id, ARGV[2] now (ms), ARGV[3] '1' when the run holds nothing afterwards,
-- ARGV[4] the settlement's sequence number (the run's settlement revision it commits as), then
-- per ledger key: reserved delta, consumed delta, and what the run holds on it afterwards ('' for
-- a key the run has no reservation on), and last a token naming this settlement alone (the
-- sequence number repeats when a settlement rolled back and the next one commits as it).
-- Returns the ledger sequence it advanced to when it applied an increase (Postgres records it
-- with the settlement: a Redis restored from before it is then behind), 0 when it applied none,
-- NOT_LOADED, MISSING (+ the index of every ledger key never loaded), OUT_OF_RANGE
-- (+ index of a key a figure of which would leave the ledger's range), or PENDING (+ its
-- sequence number) when an earlier settlement of the run is still parked: resolve it first.
-- Nothing is changed unless the answer is a number.
-- Amounts stay strings: a Lua number prints as 1e+14 and HINCRBY refuses it.
local MAX = 9007199254740991
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
local parked = redis.call('HGET', KEYS[3], 'seq')
if parked then
  return {'PENDING', parked}
end
local n = #KEYS - 5
local function fits(key, field, delta)
  local after = tonumber(redis.call('HGET', key, field) or '0') + tonumber(delta)
  return after <= MAX and after >= -MAX
end
local missing = {'MISSING'}
for i = 1, n do
  if redis.call('EXISTS', KEYS[5 + i]) == 0 then
    missing[#missing + 1] = tostring(i)
  end
end
if #missing > 1 then
  return missing
end
for i = 1, n do
  if not (fits(KEYS[5 + i], 'reserved', ARGV[2 + 3 * i]) and fits(KEYS[5 + i], 'consumed', ARGV[3 + 3 * i])) then
    return {'OUT_OF_RANGE', tostring(i)}
  end
end
local tightened = false
for i = 1, n do
  for j, field in ipairs({'reserved', 'consumed'}) do
    local delta = ARGV[1 + j + 3 * i]
    if string.sub(delta, 1, 1) ~= '-' and delta ~= '0' then
      redis.call('HINCRBY', KEYS[5 + i], field, delta)
      tightened = true
    end
  end
end
local keys = {}
for i = 1, n do
  keys[i] = KEYS[5 + i]
end
redis.call('HSET', KEYS[3], 'seq', ARGV[4], 'at', ARGV[2], 'keys', cjson.encode(keys), 'args', cjson.encode(ARGV), 'token', ARGV[5 + 3 * n])
redis.call('SADD', KEYS[4], KEYS[3])
if tightened then
  return redis.call('INCRBY', KEYS[5], SEQ_STEP)
end
return 0
