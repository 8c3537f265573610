"""The Lua scripts of RedisStore's session keys (lease, fence, manifest): each runs atomically on the one
node that holds the session's hash tag."""

# KEYS: lease, fence. ARGV: owner, ttl ms. -> {1, fence} taken or renewed; {0, "<owner>:<fence>"} busy.
ACQUIRE_LUA = """
local cur = redis.call('GET', KEYS[1])
local mine = ARGV[1] .. ':'
if cur and string.sub(cur, 1, #mine) ~= mine then return {0, cur} end
local fence
if cur then fence = tonumber(string.sub(cur, #mine + 1)) else fence = redis.call('INCR', KEYS[2]) end
redis.call('SET', KEYS[1], mine .. fence, 'PX', ARGV[2])
return {1, fence}
"""

# KEYS: lease, owner. -> 1 released, 0 not ours.
RELEASE_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: manifest, lease, fence. ARGV: data, expected generation, owner, ttl ms.
# -> {1, fence} committed; {0, holder} lease busy; {-1, stored generation or "unreadable"} conflict.
# The stored manifest being these very bytes commits again (the same commit landed and its reply was lost: redis-py
# sends a command again after a connection error, and that second run must not turn into a conflict).
COMMIT_LUA = """
local cur = redis.call('GET', KEYS[2])
local mine = ARGV[3] .. ':'
if cur and string.sub(cur, 1, #mine) ~= mine then return {0, cur} end
local old = redis.call('GET', KEYS[1])
if old ~= ARGV[1] then
  local gen = 0
  if old then
    local ok, doc = pcall(cjson.decode, old)
    if not ok or type(doc) ~= 'table' or type(doc.generation) ~= 'number' then return {-1, 'unreadable'} end
    gen = doc.generation
  end
  if gen ~= tonumber(ARGV[2]) then return {-1, tostring(gen)} end
end
local fence
if cur then fence = tonumber(string.sub(cur, #mine + 1)) else fence = redis.call('INCR', KEYS[3]) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], mine .. fence, 'PX', ARGV[4])
return {1, fence}
"""

