-- Check and reserve on every ledger key of one decision, or on none.
-- KEYS[1] loaded marker, KEYS[2] run key, KEYS[3..] ledger keys
-- ARGV[1] decision id, ARGV[2] now (ms), then per ledger key: amount, limit, hard (1|0)
-- Returns {status, reserved_1, consumed_1, reserved_2, consumed_2, ...}; status is
-- RESERVED, REJECTED (a hard key lacks room; nothing reserved), NOT_LOADED (the ledger was
-- lost and must be rebuilt from Postgres), MISSING (a ledger key was never loaded; its index
-- follows) or DUPLICATE (this run already holds a reservation; its decision id follows).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {'DUPLICATE', redis.call('HGET', KEYS[2], '_decision') or ''}
end
local n = #KEYS - 2
local reply = {'RESERVED'}
local fits = true
for i = 1, n do
  local state = redis.call('HMGET', KEYS[2 + i], 'reserved', 'consumed')
  if not state[1] then
    return {'MISSING', tostring(i)}
  end
  local reserved = tonumber(state[1])
  local consumed = tonumber(state[2] or '0')
  local amount = tonumber(ARGV[3 * i])
  local limit = tonumber(ARGV[3 * i + 1])
  if ARGV[3 * i + 2] == '1' and amount > limit - reserved - consumed then
    fits = false
  end
  reply[#reply + 1] = reserved
  reply[#reply + 1] = consumed
end
if not fits then
  reply[1] = 'REJECTED'
  return reply
end
for i = 1, n do
  redis.call('HINCRBY', KEYS[2 + i], 'reserved', ARGV[3 * i])
  redis.call('HSET', KEYS[2], KEYS[2 + i], ARGV[3 * i])
end
redis.call('HSET', KEYS[2], '_decision', ARGV[1], '_at', ARGV[2])
return reply
