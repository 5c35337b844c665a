"""The Lua scripts of a batch's state changes; each touches only the batch's slot."""

LEASE = """
-- KEYS[1] lease, KEYS[2] flight, KEYS[3] deferred; ARGV[1] holder, ARGV[2] ms, ARGV[3] due
-- ms. 2: taken now, 1: renewed, 0: another holds it. Taken over, the lines in flight are due
-- again by ARGV[3]: the last holder may have died between recording and queueing them.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local by = tonumber(ARGV[3])
  for _, line in ipairs(redis.call('HKEYS', KEYS[2])) do
    local due = redis.call('ZSCORE', KEYS[3], line)
    if not due or tonumber(due) > by then redis.call('ZADD', KEYS[3], by, line) end
  end
  return 2
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

START = """
-- KEYS[1] meta, KEYS[2] order; ARGV[1] status (in_progress or failed), ARGV[2] now s,
-- ARGV[3] total, ARGV[4] errors JSON, ARGV[5] model, ARGV[6] the admission order (line
-- numbers as uint32 LE, shortest first). Only a validating batch moves on.
if redis.call('HGET', KEYS[1], 'status') ~= 'validating' then return 0 end
local stamp = ARGV[1] == 'failed' and 'failed_at' or 'in_progress_at'
redis.call('HSET', KEYS[1], 'status', ARGV[1], stamp, ARGV[2], 'total', ARGV[3],
           'errors', ARGV[4], 'model', ARGV[5])
if ARGV[6] ~= '' then redis.call('SET', KEYS[2], ARGV[6]) end
return 1
"""

CREATE = """
-- KEYS[1] meta; ARGV field, value pairs. 1: created; 0: a batch with this id exists (the
-- id of a create with an Idempotency-Key is derived from it, so a repeat finds the first).
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

CANCEL = """
-- KEYS[1] meta; ARGV[1] now s. A batch not yet final becomes cancelling; the status after.
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
  return 'cancelling'
end
return status
"""

ADMIT = """
-- KEYS meta, done, flight, deferred; ARGV[1] the new cursor, ARGV[2] when an admitted line
-- is due again if no answer came (ms: the flight timeout), then (line, attempt) pairs.
-- Records the lines as in flight (those not answered meanwhile); returns how many.
local meta, done, flight, deferred = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if redis.call('HGET', meta, 'status') ~= 'in_progress' then return -1 end
local recorded = 0
for i = 3, #ARGV, 2 do
  if redis.call('GETBIT', done, ARGV[i]) == 0 then
    redis.call('HSET', flight, ARGV[i], ARGV[i + 1])
    redis.call('ZADD', deferred, ARGV[2], ARGV[i])
    recorded = recorded + 1
  end
end
if tonumber(ARGV[1]) > tonumber(redis.call('HGET', meta, 'cursor') or '0') then
  redis.call('HSET', meta, 'cursor', ARGV[1])
end
return recorded
"""

SETTLE = """
-- KEYS meta, done, flight, deferred, parts, output, errors, reply.
-- ARGV[1] replies handled (dropped from the reply list's old end), then counted groups:
-- answers (line, ok, output line), retries (line, attempt, due ms), parts kept (request
-- id, envelope), parts dropped (request id). A line is answered once: its done bit. A line
-- in flight keeps its attempt in `flight` and, in `deferred`, when it is due again.
local meta, done, flight, deferred, parts = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local i, settled = 2, 0
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local line, ok, out = ARGV[i], ARGV[i + 1], ARGV[i + 2]; i = i + 3
  if redis.call('SETBIT', done, line, 1) == 0 then
    redis.call('RPUSH', ok == '1' and KEYS[6] or KEYS[7], out)
    redis.call('HINCRBY', meta, ok == '1' and 'completed' or 'failed', 1)
    redis.call('HINCRBY', meta, ok == '1' and 'output_bytes' or 'errors_bytes', #out + 1)
    settled = settled + 1
  end
  redis.call('HDEL', flight, line)
  redis.call('ZREM', deferred, line)
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local line, attempt, due = ARGV[i], ARGV[i + 1], ARGV[i + 2]; i = i + 3
  if redis.call('HGET', flight, line) == attempt then
    redis.call('ZADD', deferred, due, line)
  end
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('HSET', parts, ARGV[i], ARGV[i + 1]); i = i + 2
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('HDEL', parts, ARGV[i]); i = i + 1
end
local handled = tonumber(ARGV[1])
if handled > 0 then redis.call('LTRIM', KEYS[8], 0, -handled - 1) end
return settled
"""

FINISH = """
-- KEYS meta, done, flight, deferred, parts, output, errors, output file, errors file, order.
-- ARGV[1] final status, ARGV[2] now s, ARGV[3] 1 when this call ends the batch, then
-- (line, error line) pairs for the lines never answered (expired, cancelled).
local meta, done = KEYS[1], KEYS[2]
for i = 4, #ARGV, 2 do
  if redis.call('SETBIT', done, ARGV[i], 1) == 0 then
    redis.call('RPUSH', KEYS[7], ARGV[i + 1])
    redis.call('HINCRBY', meta, 'failed', 1)
    redis.call('HINCRBY', meta, 'errors_bytes', #ARGV[i + 1] + 1)
  end
end
if ARGV[3] ~= '1' then return 0 end
local id, owner = redis.call('HGET', meta, 'id'), redis.call('HGET', meta, 'owner')
local fields = {'status', ARGV[1], ARGV[1] .. '_at', ARGV[2]}
if ARGV[1] == 'completed' then
  table.insert(fields, 'finalizing_at')
  table.insert(fields, ARGV[2])
end
for k, kind in ipairs({'output', 'errors'}) do
  local lines = KEYS[5 + k]
  if redis.call('EXISTS', lines) == 1 then
    local file_id = 'file-' .. id .. '-' .. kind
    local bytes = redis.call('HGET', meta, kind .. '_bytes') or '0'
    redis.call('HSET', KEYS[7 + k], 'id', file_id, 'bytes', bytes, 'created_at', ARGV[2],
               'filename', id .. '_' .. kind .. '.jsonl', 'purpose', 'batch_output',
               'owner', owner)
    table.insert(fields, k == 1 and 'output_file_id' or 'error_file_id')
    table.insert(fields, file_id)
  end
end
redis.call('HSET', meta, unpack(fields))
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[10])
return 1
"""
