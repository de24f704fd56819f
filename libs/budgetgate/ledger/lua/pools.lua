-- Shared by the scripts that touch token pools; prepended to them when they are registered.
-- One pool level is four keys: leases (zset token -> lease expiry ms), owners (hash token ->
-- project TAB sub-namespace), projects (hash project -> tokens held), subns (hash sub-namespace
-- -> tokens held).

local function pool_decr(key, field)
  if redis.call('HINCRBY', key, field, -1) <= 0 then
    redis.call('HDEL', key, field)
  end
end

local function pool_drop(k, token)
  local owner = redis.call('HGET', k[2], token)
  if owner then
    local tab = string.find(owner, '\t', 1, true)
    local project, subns = string.sub(owner, 1, tab - 1), string.sub(owner, tab + 1)
    if project ~= '' then pool_decr(k[3], project) end
    if subns ~= '' then pool_decr(k[4], subns) end
    redis.call('HDEL', k[2], token)
  end
  return redis.call('ZREM', k[1], token)
end

-- Leases that ran out are reclaimed before anything is counted.
local function pool_purge(k, now)
  for _, token in ipairs(redis.call('ZRANGEBYSCORE', k[1], '-inf', now)) do
    pool_drop(k, token)
  end
end

-- OK, HELD (this token already holds), EXHAUSTED (pool full) or CAP (project or sub-namespace
-- cap reached while the pool has room); then tokens used, by the project, by the sub-namespace.
local function pool_check(k, token, project, subns, quota, project_cap, subns_cap)
  local used = redis.call('ZCARD', k[1])
  local by_project = tonumber(project ~= '' and redis.call('HGET', k[3], project) or 0) or 0
  local by_subns = tonumber(subns ~= '' and redis.call('HGET', k[4], subns) or 0) or 0
  local status = 'OK'
  if redis.call('ZSCORE', k[1], token) then
    status = 'HELD'
  elseif used >= quota then
    status = 'EXHAUSTED'
  elseif (project_cap >= 0 and project ~= '' and by_project >= project_cap)
      or (subns_cap >= 0 and subns ~= '' and by_subns >= subns_cap) then
    status = 'CAP'
  end
  return status, used, by_project, by_subns
end

local function pool_take(k, token, project, subns, expiry)
  if not redis.call('ZSCORE', k[1], token) then
    if project ~= '' then redis.call('HINCRBY', k[3], project, 1) end
    if subns ~= '' then redis.call('HINCRBY', k[4], subns, 1) end
    redis.call('HSET', k[2], token, project .. '\t' .. subns)
  end
  redis.call('ZADD', k[1], expiry, token)
end

local function pool_keys(base)
  return {KEYS[base], KEYS[base + 1], KEYS[base + 2], KEYS[base + 3]}
end
