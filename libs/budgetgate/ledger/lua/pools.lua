-- Shared by the scripts that touch token pools; prepended to them when they are registered.
-- One pool level is four keys: leases (zset token -> lease expiry ms), owners (hash token ->
-- project TAB sub-namespace), projects (hash project -> tokens held), subns (hash sub-namespace
-- -> tokens held).

local function pool_decr(key, field)
  if redis.call('HINCRBY', key, field, -1) <= 0 then
    redis.call('HDEL', key, field)
  end
end

-- The project and sub-namespace a token is held for ('' and '' when it has no owner entry).
local function pool_owner(k, token)
  local owner = redis.call('HGET', k[2], token)
  if not owner then
    return '', ''
  end
  local tab = string.find(owner, '\t', 1, true)
  return string.sub(owner, 1, tab - 1), string.sub(owner, tab + 1)
end

local function pool_drop(k, token)
  local project, subns = pool_owner(k, token)
  if project ~= '' then pool_decr(k[3], project) end
  if subns ~= '' then pool_decr(k[4], subns) end
  redis.call('HDEL', k[2], token)
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
-- A held token asked for another project or sub-namespace counts against the new one's cap as a
-- new token would, and moves to it when taken (the admission API refuses such a renewal before
-- asking; the caps and the owner stay right whatever asks).
local function pool_check(k, token, project, subns, quota, project_cap, subns_cap)
  local used = redis.call('ZCARD', k[1])
  local by_project = tonumber(project ~= '' and redis.call('HGET', k[3], project) or 0) or 0
  local by_subns = tonumber(subns ~= '' and redis.call('HGET', k[4], subns) or 0) or 0
  local held = redis.call('ZSCORE', k[1], token)
  local old_project, old_subns = '', ''
  if held then
    old_project, old_subns = pool_owner(k, token)
  end
  local capped = (project_cap >= 0 and project ~= '' and project ~= old_project and by_project >= project_cap)
      or (subns_cap >= 0 and subns ~= '' and subns ~= old_subns and by_subns >= subns_cap)
  local status = 'OK'
  if held then
    status = capped and 'CAP' or 'HELD'
  elseif used >= quota then
    status = 'EXHAUSTED'
  elseif capped then
    status = 'CAP'
  end
  return status, used, by_project, by_subns
end

-- Take a token, or renew it (moved to the project and sub-namespace asked, if others).
local function pool_take(k, token, project, subns, expiry)
  local old_project, old_subns = '', ''
  if redis.call('ZSCORE', k[1], token) then
    old_project, old_subns = pool_owner(k, token)
  end
  if old_project ~= project then
    if old_project ~= '' then pool_decr(k[3], old_project) end
    if project ~= '' then redis.call('HINCRBY', k[3], project, 1) end
  end
  if old_subns ~= subns then
    if old_subns ~= '' then pool_decr(k[4], old_subns) end
    if subns ~= '' then redis.call('HINCRBY', k[4], subns, 1) end
  end
  redis.call('HSET', k[2], token, project .. '\t' .. subns)
  redis.call('ZADD', k[1], expiry, token)
end

local function pool_keys(base)
  return {KEYS[base], KEYS[base + 1], KEYS[base + 2], KEYS[base + 3]}
end
