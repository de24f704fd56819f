-- Give back a run's concurrency holds (quota counters and pool tokens) when it ends; its budget
-- charges are settled separately. KEYS: [1] loaded marker, [2] run holds key, then the keys the
-- holds key names (see holds.lua). Returns the number released, NOT_LOADED, or STALE_KEYS.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'NOT_LOADED'}
end
local entries = holds_read(KEYS[2], 3)
if not entries then
  return {'STALE_KEYS'}
end
holds_release(KEYS[2], entries)
return #entries
