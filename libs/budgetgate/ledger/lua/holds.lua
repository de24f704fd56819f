-- Shared by the scripts that count a run's concurrency holds and give them back; prepended after pools.lua.
-- A run holds key maps each counter key (:q:) to "gpus,nodes,allocations" and each pool
-- level's leases key to the run's token. Its keys are passed in KEYS from index `first`: a
-- counter key stands alone, a pool level is its leases key followed by its three siblings.

-- Checks the keys given are exactly those the holds key names; returns the entries or nil.
local function holds_read(holds_key, first)
  local entries = {}
  local i = first
  while i <= #KEYS do
    local value = redis.call('HGET', holds_key, KEYS[i])
    if not value then
      return nil
    end
    local pool = string.sub(KEYS[i], -7) == ':leases'
    entries[#entries + 1] = {i, value, pool}
    i = i + (pool and 4 or 1)
  end
  if redis.call('HLEN', holds_key) ~= #entries then
    return nil
  end
  return entries
end

-- Counts a run on a counter key (its gpus, nodes and allocations) and records it in the run's
-- holds key, for holds_release to take back.
local function holds_count(holds_key, key, gpus, nodes, allocations)
  redis.call('HINCRBY', key, 'gpus', gpus)
  redis.call('HINCRBY', key, 'nodes', nodes)
  redis.call('HINCRBY', key, 'allocations', allocations)
  redis.call('HSET', holds_key, key, gpus .. ',' .. nodes .. ',' .. allocations)
end

local function holds_release(holds_key, entries)
  for _, e in ipairs(entries) do
    if e[3] then
      pool_drop(pool_keys(e[1]), e[2])
    else
      local g, nd, a = string.match(e[2], '^(%-?%d+),(%-?%d+),(%-?%d+)$')
      redis.call('HINCRBY', KEYS[e[1]], 'gpus', -tonumber(g))
      redis.call('HINCRBY', KEYS[e[1]], 'nodes', -tonumber(nd))
      redis.call('HINCRBY', KEYS[e[1]], 'allocations', -tonumber(a))
    end
  end
  redis.call('DEL', holds_key)
end
