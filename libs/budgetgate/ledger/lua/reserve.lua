-- Check and reserve, for a batch of decisions in submission order, everything each decision
-- needs or nothing of it: budget charges on ledger keys, concurrency on quota counters, and
-- tokens in pools. Decisions are independent: one refused does not refuse the next.
--
-- Ledger generation: KEYS[2] holds a sequence every reserving decision advances, and Postgres
-- records the value with the decision (decisions.ledger_seq); the other writes that take room
-- advance it too, recorded in ledger_marks (migration 0025). ARGV[1] is the highest value
-- Postgres has committed. A Redis whose sequence is behind it lost reservations Postgres holds
-- (restored from a snapshot, a lagging replica): it invalidates itself (drops the loaded
-- marker) and answers NOT_LOADED, so it is rebuilt from Postgres before anything is decided.
-- A Redis ahead of it is normal: reservations in flight, or whose transaction failed (gaps).
--
-- KEYS: [1] loaded marker, [2] sequence; then per decision: run key (its budget charges), run
--       holds key (its counters and tokens), n ledger keys, m counter keys, and 4 keys per pool
--       level (pools.lua).
-- ARGV: [1] sequence Postgres committed, [2] now ms, [3] decisions, [4] mode: 'reserve', or
--       'check' (a quote: the same checks and readings, nothing held, a run's own earlier hold
--       ignored, a ledger key never loaded read as empty and named); then per decision:
--       decision id, n, m, pool levels (-1: none, and the decision is refused elsewhere, its
--       pool token on the pools' shard of a ledger of several shards: read, never held);
--       per ledger key: amount, limit, hard (1|0, or L for an
--       escrow lease, whose limit is its size field, lease.lua); per counter:
--       gpus, nodes, allocations to add, then their limits (-1 = none, -2 = the counter's size
--       field: an escrow lease of a counter tenants share, 0 unless its unit field names the
--       limit's, gpus or nodes, lease.lua); then token, project,
--       sub-namespace, lease expiry ms; per pool level: quota, project cap, sub-namespace cap
--       (-1 = none).
-- Returns NOT_LOADED (rebuild from Postgres first), or {'OK', reply...} with one reply per
-- decision: {status, ledger (reserved, consumed)..., counter (gpus, nodes, allocations[, size
-- for a lease])...,
-- pool (check, used, by project, by sub-namespace)..., sequence (RESERVED only)}, the escrow
-- leases' sizes following the ledger keys' pairs (one per lease charge, in order); a pool's check
-- is pools.lua's, or TAKEN (the token is held already, by another holder than this run); status is
-- RESERVED, REJECTED (something lacks room; nothing changed), MISSING (a ledger key was never
-- loaded; its index follows) or DUPLICATE (this run holds already; the holder's decision id).
-- In check mode the status is FITS or REJECTED, followed by the indexes of unloaded ledger keys.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 'NOT_LOADED'
end
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return 'NOT_LOADED'
end
local now = tonumber(ARGV[2])
local check = ARGV[4] == 'check'

local function reserve(kb, ab)
  -- kb: index of the run key in KEYS; ab: index of the decision id in ARGV.
  local run, holds = KEYS[kb], KEYS[kb + 1]
  local n, m, levels = tonumber(ARGV[ab + 1]), tonumber(ARGV[ab + 2]), tonumber(ARGV[ab + 3])
  local refused = levels < 0
  if refused then
    levels = 0
  end
  if not check and redis.call('EXISTS', run) == 1 then
    return {'DUPLICATE', redis.call('HGET', run, '_decision') or ''}
  end
  local reply = {'RESERVED'}
  local fits = true
  local unloaded = {}
  local sizes = {}

  for i = 1, n do
    local state = redis.call('HMGET', KEYS[kb + 1 + i], 'reserved', 'consumed')
    if not state[1] then
      if not check then
        return {'MISSING', tostring(i)}
      end
      unloaded[#unloaded + 1] = i
      state = {'0', '0'}
    end
    local reserved, consumed = tonumber(state[1]), tonumber(state[2] or '0')
    local a = ab + 3 + 3 * (i - 1)
    local limit = tonumber(ARGV[a + 2])
    if ARGV[a + 3] == 'L' then
      -- an escrow lease: its size is its limit (lease.lua); read for leases alone
      limit = tonumber(redis.call('HGET', KEYS[kb + 1 + i], 'size') or '0')
      sizes[#sizes + 1] = limit
    end
    if ARGV[a + 3] ~= '0' and tonumber(ARGV[a + 1]) > limit - reserved - consumed then
      fits = false
    end
    reply[#reply + 1] = reserved
    reply[#reply + 1] = consumed
  end
  for _, size in ipairs(sizes) do
    reply[#reply + 1] = size
  end

  local counters = ab + 3 + 3 * n
  for j = 1, m do
    local held = redis.call('HMGET', KEYS[kb + 1 + n + j], 'gpus', 'nodes', 'allocations', 'size', 'unit')
    local a = counters + 6 * (j - 1)
    local lease = nil
    for f = 1, 3 do
      local current = tonumber(held[f] or '0')
      local limit = tonumber(ARGV[a + 3 + f])
      if limit == -2 then
        -- an escrow lease of a counter tenants share: its size is the limit, in the unit it was
        -- granted in (lease.lua); a size in another unit holds nothing of this one
        lease = (held[5] == (f == 1 and 'gpus' or 'nodes')) and tonumber(held[4] or '0') or 0
        limit = lease
      end
      if limit >= 0 and current + tonumber(ARGV[a + f]) > limit then
        fits = false
      end
      reply[#reply + 1] = current
    end
    if lease then
      reply[#reply + 1] = lease
    end
  end

  local pools = counters + 6 * m
  local token, project, subns = ARGV[pools + 1], ARGV[pools + 2], ARGV[pools + 3]
  local expiry = tonumber(ARGV[pools + 4])
  for l = 1, levels do
    local k = pool_keys(kb + 2 + n + m + 4 * (l - 1))
    pool_purge(k, now)
    local a = pools + 4 + 3 * (l - 1)
    local status, used, by_project, by_subns = pool_check(k, token, project, subns, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
    if redis.call('ZSCORE', k[1], token) and (not check or redis.call('HGET', holds, k[1]) ~= token) then
      -- Reserving, a held token is not this run's (a run is decided again only after a refusal,
      -- which holds nothing; its own orphan was a DUPLICATE): another holder's, never taken
      -- over, in Postgres neither. A check skips the DUPLICATE test (a quote of an admitted run
      -- evaluates it afresh), so it asks the run's holds key whether the token is the run's own:
      -- a quote must predict the refusal the submission would get, yet not refuse a run for the
      -- token it holds itself.
      status = 'TAKEN'
    end
    if status == 'EXHAUSTED' or status == 'CAP' or status == 'TAKEN' then
      fits = false
    end
    reply[#reply + 1] = status
    reply[#reply + 1] = used
    reply[#reply + 1] = by_project
    reply[#reply + 1] = by_subns
  end

  if refused then
    fits = false
  end
  if not fits then
    reply[1] = 'REJECTED'
  elseif check then
    reply[1] = 'FITS'
  end
  if check then
    for _, i in ipairs(unloaded) do
      reply[#reply + 1] = i
    end
    return reply
  end
  if not fits then
    return reply
  end

  for i = 1, n do
    local amount = ARGV[ab + 3 + 3 * (i - 1) + 1]
    redis.call('HINCRBY', KEYS[kb + 1 + i], 'reserved', amount)
    redis.call('HSET', run, KEYS[kb + 1 + i], amount)
  end
  for j = 1, m do
    local a = counters + 6 * (j - 1)
    holds_count(holds, KEYS[kb + 1 + n + j], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3])
  end
  for l = 1, levels do
    local k = pool_keys(kb + 2 + n + m + 4 * (l - 1))
    pool_take(k, token, project, subns, expiry)
    redis.call('HSET', holds, k[1], token)
  end
  local seq = redis.call('INCRBY', KEYS[2], SEQ_STEP)
  redis.call('HSET', run, '_decision', ARGV[ab], '_at', ARGV[2])
  reply[#reply + 1] = seq
  return reply
end

local replies = {'OK'}
local kb, ab = 3, 5
for _ = 1, tonumber(ARGV[3]) do
  local n, m, levels = tonumber(ARGV[ab + 1]), tonumber(ARGV[ab + 2]), math.max(tonumber(ARGV[ab + 3]), 0)
  replies[#replies + 1] = reserve(kb, ab)
  kb = kb + 2 + n + m + 4 * levels
  ab = ab + 4 + 3 * n + 6 * m + 4 + 3 * levels
end
return replies
