-- Extend the leases of held tokens, each on all of its levels or on none, as allocate.lua renews
-- one (pool_take, for the project and sub-namespace it is held for). A token whose lease ran
-- out by `now` on a level, or that a level does not hold, may have had its place taken there: it
-- is left to run out, never taken again (that is an allocation, with its checks).
-- KEYS: [1] loaded marker, then per token 4 keys per pool level (pools.lua), most specific first,
-- and last the ledger sequence (see reserve.lua).
-- ARGV: [1] now ms, [2] tokens; then per token: token, lease expiry ms, levels.
-- Returns per token 1 (renewed) or 0 (not held), then the ledger sequence it advanced to when it
-- renewed any (Postgres records it with the leases) or 0; or NOT_LOADED.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
local now = tonumber(ARGV[1])
local renewed = {}
local any = false
local kb, ab = 2, 3
for t = 1, tonumber(ARGV[2]) do
  local token, expiry, levels = ARGV[ab], tonumber(ARGV[ab + 1]), tonumber(ARGV[ab + 2])
  local held = true
  for l = 1, levels do
    local k = pool_keys(kb + 4 * (l - 1))
    pool_purge(k, now)
    held = held and redis.call('ZSCORE', k[1], token) ~= false
  end
  if held then
    for l = 1, levels do
      local k = pool_keys(kb + 4 * (l - 1))
      local project, subns = pool_owner(k, token)
      pool_take(k, token, project, subns, expiry)
    end
  end
  renewed[t] = held and 1 or 0
  any = any or held
  kb, ab = kb + 4 * levels, ab + 3
end
renewed[#renewed + 1] = any and redis.call('INCRBY', KEYS[#KEYS], SEQ_STEP) or 0
return renewed
