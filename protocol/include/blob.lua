-- include/blob.lua: BLOB_SHORTEST, blob_maybe and blob_lib, whose table
-- holds is, prefix, missing, gone, ref, unref, unref_record, merge and
-- merge_pairs (the functions blob_is, blob_prefix, ... below, with blob_key,
-- which they use) (a payload stored out of line: see "Big payloads out of
-- line (version 10)" in README.md); needs nothing.

-- A payload longer than BLOB_MIN (1 MiB) is stored in {ns}:blob:<sha1hex>
-- (HASH: 'd' the payload, 'n' the entries that reference it), and every entry
-- of a queue holds its stand-in instead:
--   '\0mesh-blob\0' .. sha1hex .. '\0' .. size .. '\0' .. first 256 bytes
-- The helpers take the namespace's prefix ({ns}:, blob_prefix) and the entry.

-- No string shorter than this is a stand-in (the mark, 40 hex digits, a
-- digit and a NUL byte; a real one, of a payload over 1 MiB, is 316 bytes or
-- more). This test (#p, an opcode: no call) comes first on a hot path, then
-- the first byte (string.byte(p, 1) == 0), then the mark.
local BLOB_SHORTEST = 54

-- Whether any of `list[first..]` may be a stand-in (as long as the shortest
-- one, and its first byte NUL): a script that adds copies asks for the blob
-- functions (below) only then.
local function blob_maybe(list, first)
  local shortest = BLOB_SHORTEST  -- in a register: one test per payload
  for i = first, #list do
    if #list[i] >= shortest and string.byte(list[i], 1) == 0 then return true end
  end
  return false
end

-- The functions are made on first use: a script calls blob_lib() for their
-- table (made once per call; as include/group.lua's: a call that meets no
-- stand-in makes none of their closures).
local blob_fns

local function blob_lib()
  if blob_fns then return blob_fns end
  local BLOB_MARK = '\0mesh-blob\0'

  -- Whether `p` is a stand-in.
  local function blob_is(p)
    return #p >= BLOB_SHORTEST and string.byte(p, 1) == 0 and string.sub(p, 1, 11) == BLOB_MARK
  end

  -- The namespace's prefix ({ns}:) of a key of it.
  local function blob_prefix(key)
    return string.match(key, '^(%b{}:)')
  end

  -- The blob key of stand-in `p`.
  local function blob_key(prefix, p)
    return prefix .. 'blob:' .. string.sub(p, 12, 51)
  end

  -- Of `list[first..]`: the index of the first stand-in whose blob is gone
  -- (its upload expired), or nil; and whether it holds any stand-in. A script
  -- that adds copies calls it before its first write (and refuses the call for
  -- a blob gone), and refs the copies only when there is any.
  local function blob_missing(prefix, list, first)
    local any, shortest = false, BLOB_SHORTEST  -- in a register: one test per payload
    for i = first, #list do
      local p = list[i]
      if #p >= shortest and blob_is(p) then
        if redis.call('EXISTS', blob_key(prefix, p)) == 0 then return i, true end
        any = true
      end
    end
    return nil, any
  end

  -- The refusal of a call whose task `i` (from 0) is a stand-in whose blob is
  -- gone: nothing was written; the caller uploads it again and retries.
  local function blob_gone(i)
    return redis.error_reply('CONFLICT task ' .. i .. ' of this call is a big payload whose blob is gone '
      .. '(its upload expired): upload it again')
  end

  -- One more entry references stand-in `p` (a no-op for a plain payload): its
  -- count goes up, and the blob no longer expires.
  local function blob_ref(prefix, p)
    if #p >= BLOB_SHORTEST and blob_is(p) then
      local k = blob_key(prefix, p)
      redis.call('HINCRBY', k, 'n', 1)
      redis.call('PERSIST', k)
    end
  end

  -- `k` entries (1 when nil) referencing stand-in `p` left for good (a no-op
  -- for a plain payload): the blob goes with its last reference.
  local function blob_unref(prefix, p, k)
    if #p >= BLOB_SHORTEST and blob_is(p) then
      local key = blob_key(prefix, p)
      if redis.call('HINCRBY', key, 'n', -(k or 1)) <= 0 then redis.call('DEL', key) end
    end
  end

  -- blob_unref of the payload of record `rec` (a process record or a dead
  -- letter: the payload is the part after the `fields`-th NUL byte); `key` is
  -- any key of the namespace (its prefix is read only for a stand-in). A
  -- length test and one plain find of the mark first: a record of a plain
  -- payload costs nothing more.
  local function blob_unref_record(key, rec, fields)
    if #rec < BLOB_SHORTEST or not string.find(rec, BLOB_MARK, 1, true) then return end
    local pos = 1
    for _ = 1, fields do pos = string.find(rec, '\0', pos, true) + 1 end
    blob_unref(blob_prefix(key), string.sub(rec, pos))
  end

  -- Before a ZADD of `member` (its payload `p`) into the delayed set `key`: a
  -- stand-in's copy that merges with one already there (a payload waits in a
  -- delayed set once) drops its reference.
  local function blob_merge(key, member, p)
    if #p >= BLOB_SHORTEST and blob_is(p) and redis.call('ZSCORE', key, member) then
      blob_unref(blob_prefix(key), p)
    end
  end

  -- blob_merge for a ZADD of score/member `pairs` into `key`, whose members'
  -- payloads start after `skip` bytes, or after their first NUL byte and two
  -- more, the flag and the level (`skip` nil: a group's delayed set); members
  -- repeated in `pairs` merge too.
  local function blob_merge_pairs(key, pairs, skip)
    local seen = {}
    for i = 2, #pairs, 2 do
      local m = pairs[i]
      local p = #m >= BLOB_SHORTEST and (skip and string.sub(m, skip + 1)
        or string.sub(m, string.find(m, '\0', 1, true) + 3)) or ''
      if blob_is(p) then
        if seen[m] or redis.call('ZSCORE', key, m) then blob_unref(blob_prefix(key), p) end
        seen[m] = true
      end
    end
  end

  blob_fns = {is = blob_is, prefix = blob_prefix, missing = blob_missing, gone = blob_gone,
    ref = blob_ref, unref = blob_unref, unref_record = blob_unref_record, merge = blob_merge,
    merge_pairs = blob_merge_pairs}
  return blob_fns
end
